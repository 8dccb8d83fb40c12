"""The job runner and its adapters: actions from the bus, checked, carried out (or only logged).

``runner.py`` is the consume/decide/report loop; ``adapters.py`` picks an adapter by name;
``adapter_*.py`` turn one action into argv steps (never a shell string).
"""
