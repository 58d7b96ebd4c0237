"""Everything that touches megatron-core and ``parallel_state`` lives in this package."""
