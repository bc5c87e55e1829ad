"""Offline indices for dynamic draft vocabularies, bound to a model by a manifest.

Owns: the token-frequency table (``frequency``), the bigram successor graph (``bigram``), the
norm-augmented HNSW index over LM-head rows (``hnsw``), the manifest and verified loading
(``manifest``), building (``build``), the per-model default directory (``default``), the
corpora they are counted from (``corpus``) and the ``evospec-index`` CLI (``cli``).

The decoding engine reads an ``IndexBundle``; it never builds one on its hot path.
"""
