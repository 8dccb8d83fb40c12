"""faultlens: find the faulty machine in a large GPU training job.

The root package holds the CLI, configuration, logging and the exception tree;
the parts live in faultlens.collectors, .stream, .models, .diagnosis, .ui and
.datasets (see docs/design.md).
"""

__version__ = "0.1.0"
