"""The API's sampling ranges, shared with `kvq submit` (no imports: the CLI parser loads it)."""

MAX_TEMPERATURE = 2.0
