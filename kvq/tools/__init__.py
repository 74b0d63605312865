"""Tooling around kvq, outside the runtime: the benches (`bench`), the synthetic-model writers
for tests, demos and benches (`synth`), and `kvq demo` (`demo`, `demo_acl`).

Tools may import any part of kvq; no runtime package imports `kvq.tools` (the CLI imports a
tool inside the command that runs it). `tests/unit/test_import_layers.py` holds the rule.
"""
