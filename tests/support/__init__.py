"""Helpers shared by the test files; the fixtures built on them are in tests/conftest.py.

- models: tiny random Hugging Face checkpoints (`build`, `TinyCheckpoints`), `variant` copies,
  `rel_err`, a word-level tokenizer;
- drafters: tiny drafter checkpoints in their published formats (EAGLE, EAGLE3, DFlash, MTP),
  agreeing ones included;
- numpy_ref: numpy forwards from raw tensors (RMS norm, RoPE, attention, SwiGLU);
- paged: `PagedHarness`, a model driven through NaN-poisoned paged caches;
- compiles: `compilations`, the watch on XLA compiles; `FAST`, -O0 compiler options;
- engines: the test engines' settings (`SMALL`, `SPEC`, `SPEC_BS4`), `check_no_leaks`, plain greedy
  references and greedy equality;
- spec: the sampling-distribution check of speculative steps;
- spec_chain, spec_eagle: the set-ups of the chain and EAGLE-family speculative suites.
"""
