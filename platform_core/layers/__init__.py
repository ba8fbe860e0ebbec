"""Building blocks of the decoder models: norms, rotary embedding, activations, row argmax,
linear layers, embeddings, the gated MLP and the paged-attention layer. Each module holds one
concept; the overridable ops (``rms_norm``, ``rotary``, ``silu_and_mul``, ``linear``,
``argmax``) are named in :mod:`.ops`.
"""
