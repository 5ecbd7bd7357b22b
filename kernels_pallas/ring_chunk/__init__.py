"""The ring's chunk op: attention of a query chunk against one key/value chunk, masked per token.

The per-round compute of ring attention (jaxsb/parallel/ring.py, ring_sparse.py): query i
sees key j iff seg_q[i] == seg_k[j] and pos_k[j] <= pos_q[i], so chunks may hold tokens in
any order. `attention_chunk` (ops.py) returns the output and the log-sum-exp, differentiable
in q, k, v; ops.py also has the float32 forward / backward pieces the ring composes
(`chunk_forward`, `chunk_backward`, `merge_chunks`). `chunk_reference` is the dense oracle.

Files: ops.py (entry points, dispatch), tables.py (blocking `ChunkBlocks` and the SKIP / FULL /
PARTIAL block tables), xla.py, pallas.py (Triton, GPU), pallas_tpu.py (Mosaic, TPU),
reference.py.
"""

from kernels_pallas.ring_chunk.ops import attention_chunk
from kernels_pallas.ring_chunk.reference import chunk_reference

__all__ = ["attention_chunk", "chunk_reference"]
