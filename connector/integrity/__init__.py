"""What keeps wrong KV out: deadlines on every transfer, device ordering, the layout verdict."""
