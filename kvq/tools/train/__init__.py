"""Training a small real model pair on the Python standard library's sources.

- `corpus`: the files (the running interpreter's standard library, fixed order, a fixed
  held-out set), the byte-level BPE trained on them with Hugging Face `tokenizers`, and the
  token streams;
- `net`: the `qwen3moe` network in torch, computed as llama.cpp and kvq compute it;
- `export`: a trained network written as GGUF with its gpt2-BPE vocabulary;
- `loop`: the training loop (checkpoints, loss curve, held-out perplexity, the JSON record);
- `stdlib_pair`: the command (`python -m kvq.tools.train.stdlib_pair`) that trains the main
  model and its draft and writes `tests/data/stdlib-moe.gguf` and `tests/data/stdlib-draft.gguf`.

Nothing in the runtime imports this package (`tests/unit/test_import_layers.py`).
"""
