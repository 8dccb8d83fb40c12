"""What a parsed log record means: the one classifier, re-exported for diagnosis.

The signature catalogs and the classifier live in ``faultlens.collectors.signatures`` (root
package) so that the node agent's ship filter, which may not import diagnosis,
reads the very same entries and code as explain, the batch path and the engine.
"""

from faultlens.collectors.signatures import (  # noqa: F401
    BAD_INPUT_RE,
    CATALOGS,
    CATEGORIES,
    FAMILIES,
    LINE_ACTIONS,
    SEVERITIES,
    UNRECOGNISED,
    Catalogs,
    Classification,
    ClassifyContext,
    Repeat,
    Rule,
    XidEntry,
    all_rules,
    catalogs,
    classify,
    classify_nvsmi,
    first_rule,
    is_ordinary,
    load_catalogs,
    load_rules,
    load_xid,
    most_significant,
    to_finding,
)
