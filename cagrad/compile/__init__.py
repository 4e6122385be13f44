"""From a captured GraphModule to a callable: backend resolution, compiling
without Dynamo, static-first specialization, boxed calls that free inputs
early, CUDA graphs, and the on-disk cache of captured graphs."""
