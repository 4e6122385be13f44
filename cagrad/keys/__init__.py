"""Collection and lookup: one CacheKey per node (CompiledNodeArgs), the lifted
tensors and size slots (SizeInput), the CacheNode trie, and the generated
hit guards that skip the full collection on a graph seen before."""
