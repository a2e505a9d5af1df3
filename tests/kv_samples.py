"""Shared test inputs built from real prefill tensors."""


def new_token(state, layer, step):
    """A plausible new key/value [Hkv, 1, d]: a prompt token's, scaled (real statistics, new content)."""
    j = state.n_tokens - 1 - 7 * step
    return state.keys[layer, :, j : j + 1] * 0.9, state.values[layer, :, j : j + 1] * 1.1
