"""The scheduler's half: lookups and the hybrid hit, load plans, save plans, the pool's reset."""
