//! Tokenizers, corpora, window sampler and the synthetic corpus.
