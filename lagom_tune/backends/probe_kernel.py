"""The contention probe's Triton kernel (``probe.py`` says what it measures and launches it).

A module of its own so that ``probe.py`` imports without Triton, and so that ``tl`` is a global of
the kernel's module: Triton resolves a kernel's names through its module's globals (Triton 3.0,
torch 2.4's, refused the kernel while ``triton.language`` was only a closure's variable).
"""

import triton
import triton.language as tl


# Block ``pid`` copies ``steps`` chunks of CHUNK words from its slice of ``src`` (``slice_chunks``
# chunks, read round and round) into its ring of 8 staging chunks, BLOCK words at a time: a channel
# block's footprint (one SM, and HBM traffic) without its partner on another GPU. With PLACE it first
# writes the id of the SM it runs on to ``place[pid]``.
@triton.jit
def probe_copy(src, stage, steps, slice_chunks, place, CHUNK: tl.constexpr, BLOCK: tl.constexpr, PLACE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    if PLACE:  # where the block runs: its SM's id (a diagnostic launch; compiled out of the measured one)
        tl.store(place + pid, tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1))
    src_base = pid * slice_chunks * CHUNK
    stage_base = pid * 8 * CHUNK
    for step in range(steps):
        s_off = src_base + (step % slice_chunks).to(tl.int64) * CHUNK
        d_off = stage_base + (step % 8) * CHUNK
        for i in range(0, CHUNK, BLOCK):
            offs = i + tl.arange(0, BLOCK)
            tl.store(stage + d_off + offs, tl.load(src + s_off + offs))
