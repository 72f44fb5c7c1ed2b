"""The workers' half: loads and saves between vLLM's blocks and the pool, through staging."""
