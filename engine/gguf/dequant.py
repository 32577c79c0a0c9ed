"""The legacy GGUF block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) dequantized with torch, on every core.

Why not gguf-py's numpy for these: they are most of what small models store (the default brain is 388 M
Q5_0 and 138 M Q8_0 values of 494 M; the bundled SmolLM2 Q4_1 and Q8_0), and gguf-py decodes them on one
core with a temporary array per step: 7.7 s for the default brain at each first start. The values are
the same to the bit (one float32 multiply, then the add of Q4_1/Q5_1, as gguf-py and ggml compute them;
``tests/engine/test_gguf.py`` checks each type against gguf-py). Other types (K-quants, F16, BF16...) stay
with gguf-py.

Block layouts (ggml-common.h): Q8_0 = f16 d, 32 int8; Q4_0 = f16 d, 16 bytes of nibbles (low nibbles
are values 0-15, high nibbles 16-31), value (q - 8) * d; Q4_1 = f16 d, f16 m, nibbles, q * d + m;
Q5_0 = f16 d, 32 high bits (little-endian u32, bit i for value i), nibbles, (q - 16) * d;
Q5_1 = f16 d, f16 m, high bits, nibbles, q * d + m.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

BLOCK = 32
# bytes of one block: (scale bytes, min bytes, high-bit bytes, value bytes)
_LAYOUT = {
    Q.Q4_0: (2, 0, 0, 16),
    Q.Q4_1: (2, 2, 0, 16),
    Q.Q5_0: (2, 0, 4, 16),
    Q.Q5_1: (2, 2, 4, 16),
    Q.Q8_0: (2, 0, 0, 32),
}
# what is subtracted from the unsigned integer (0 where the block has a min instead)
_OFFSET = {Q.Q4_0: 8, Q.Q5_0: 16}
_SHIFTS = torch.arange(8, dtype=torch.uint8)


def handles(qtype: Q) -> bool:
    return qtype in _LAYOUT


def dequantize_blocks(raw: np.ndarray, qtype: Q) -> torch.Tensor:
    """The values of ``raw`` (uint8, whole blocks of ``qtype``) as a flat float32 tensor."""
    d_bytes, m_bytes, h_bytes, v_bytes = _LAYOUT[qtype]
    blocks = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True)).view(-1, d_bytes + m_bytes + h_bytes + v_bytes)
    d = blocks[:, :d_bytes].contiguous().view(torch.float16).float()
    at = d_bytes
    m = None
    if m_bytes:
        m = blocks[:, at : at + m_bytes].contiguous().view(torch.float16).float()
        at += m_bytes
    high = None
    if h_bytes:  # bit i of the little-endian u32 is value i's fifth bit
        qh = blocks[:, at : at + h_bytes]
        high = ((qh.unsqueeze(-1) >> _SHIFTS) & 1).reshape(-1, BLOCK) << 4
        at += h_bytes
    values = blocks[:, at:]
    if qtype == Q.Q8_0:
        q = values.contiguous().view(torch.int8).float()
    else:
        q = torch.cat((values & 0x0F, values >> 4), dim=1)
        if high is not None:
            q |= high
        q = q.to(torch.int16)
        if qtype in _OFFSET:
            q -= _OFFSET[qtype]
        q = q.float()
    out = q.mul_(d)
    if m is not None:
        out.add_(m)
    return out.reshape(-1)
