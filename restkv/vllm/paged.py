"""A layer's paged KV cache as restkv reads and writes it: entries by slot, in the backend's own layout.

A slot is ``block * block_size + offset``. Every layout is a pair of index maps from (block, offset,
KV head, channel) to an element of the cache tensor, one for the keys and one for the values:

- ``declared``: the GPU backends of vLLM (FlashAttention, FlashInfer, Triton) hold a layer as a
  logical ``[blocks, H, N, C]`` page view (``vllm.v1.kv_cache_interface.create_kv_cache_views``,
  in any ``KVCacheLayout`` stride order), K and V on its last axis (``[B, Hkv, N, 2 d]``) or, where
  the backend declares ``2 Hkv`` head slots, on its head axis (``[B, 2 Hkv, N, d]``): the keys and
  values are strided views of it, checked against the layer's spec before any read.
- ``probed``: vLLM's CPU backend packs each block for its ISA (the keys of a block and head as
  ``[d, block_size]`` on AVX-512, tiles on AMX), which no shape declares: the map is read off the
  backend's own cache writer, by writing known values into a scratch block and finding where each
  lands. A map that is strided is used as a view; one that is not as an element index.

An FP8 cache (vLLM's ``kv_cache_dtype`` fp8, fp8_e4m3, fp8_e5m2: ``FP8``) holds each key as a float8
byte ``k / k_scale``, with one scale per layer for the keys and one for the values (the attention
layer's ``_k_scale`` / ``_v_scale``), in the same layouts at one byte an element: it is read through
its float8 type, keys and values dequantized to float32 (``x k_scale``) for scoring, and kept entries
are moved as stored, their bytes copied (``Paged.stored``), never quantized again.

Reads and writes are plain indexing on the cache's device, never a host read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# vLLM's per-tensor FP8 ``kv_cache_dtype`` -> the float8 type of its bytes (vLLM allocates them uint8; where a
# platform or backend writes another, ``restkv.vllm.hooks.attention.fp8`` says which)
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@dataclass
class Paged:
    """Keys and values of one layer's cache by slot.

    ``keys`` / ``values``: views [blocks, block_size, Hkv, d] of the cache tensor, or (a layout that
    is not strided) element offsets [block_size, Hkv, d] into the flat cache within a block, with
    ``block_stride`` elements from one block to the next. ``scales``: an FP8 cache's (k_scale,
    v_scale), scalar tensors on its device (``cache`` then its float8 view); None: the model's dtype.
    """

    cache: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    block_size: int
    block_stride: int = 0
    scales: tuple | None = None

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The entries of ``slots`` [n] -> keys, values [n, Hkv, d] (copies; an FP8 cache's dequantized,
        float32)."""
        return self.dequantized(self._at(self.keys, slots), self._at(self.values, slots))

    def stored(self, slots: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Head h's entries ``slots[positions[h]]`` (``slots`` [n], ``positions`` [Hkv, B]) -> keys,
        values [B, Hkv, d] as stored (an FP8 cache's bytes), as ``write`` takes them."""
        heads, kept = positions.shape
        head = torch.arange(heads, device=slots.device).repeat(kept)
        return tuple(x.view(kept, heads, -1) for x in self.stored_at(slots[positions].T.reshape(-1), head))

    def stored_at(self, slots: torch.Tensor, heads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The entries of head ``heads[i]`` at slot ``slots[i]`` ([n] each) -> keys, values [n, d] as stored."""
        axes = (slots // self.block_size, slots % self.block_size, heads)
        return tuple(self._get(where, self._locate(where, axes)) for where in (self.keys, self.values))

    def write(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write keys, values [n, Hkv, d] into ``slots`` [n] (an FP8 cache's: as stored, ``stored``)."""
        self._check_stored(keys, values)
        self._put(self.keys, slots, keys)
        self._put(self.values, slots, values)

    def read_pages(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The entries of single-head page ``slots`` [n] (``restkv.vllm.heads``: page ``block * Hkv +
        head``, slot ``page * block_size + offset``) -> keys, values [n, d] as stored (copies; an FP8 cache's
        bytes, which ``dequantized`` of their layer's ``Paged`` reads)."""
        return self._at(self.keys, slots, True), self._at(self.values, slots, True)

    def dequantized(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries as stored -> as read: an FP8 cache's times its scales, float32; the model's dtype as is."""
        if self.scales is None:
            return keys, values
        k_scale, v_scale = self.scales
        return keys.float() * k_scale, values.float() * v_scale

    def write_pages(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write keys, values [n, d] as stored (``read_pages``'s, ``stored``'s) into single-head page ``slots`` [n]."""
        self._check_stored(keys, values)
        for where, x in ((self.keys, keys), (self.values, values)):  # the keys' index, then the values'
            self._put(where, slots, x, True)

    def _check_stored(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.scales is not None and (keys.dtype, values.dtype) != (self.cache.dtype,) * 2:
            raise ValueError(f"restkv.vllm: an FP8 cache is written as stored ({self.cache.dtype}), not {keys.dtype}")

    def _index(self, where: torch.Tensor, slots: torch.Tensor, pages: bool) -> tuple:
        """(block, offset) of ``slots``, and with ``pages`` the head too (the slots then count
        single-head pages of ``block_size`` entries, ``Hkv`` per block)."""
        page, offset = slots // self.block_size, slots % self.block_size
        if not pages:
            return page, offset
        heads = where.shape[-2]
        return page // heads, offset, page % heads

    def _where(self, where: torch.Tensor, slots: torch.Tensor, pages: bool = False):
        """The index of ``slots``' entries in ``where`` (the keys or the values): ``_locate`` of their axes."""
        return self._locate(where, self._index(where, slots, pages))

    def _locate(self, where: torch.Tensor, axes: tuple):
        """(block, offset[, head]) [n] each -> the index into ``where``: the axes themselves into a strided
        view, or element offsets [n, d] into the flat cache."""
        if where.dim() == 4:
            return axes
        block, *within = axes
        return self._flat(block, where[tuple(within)])

    def _at(self, where: torch.Tensor, slots: torch.Tensor, pages: bool = False) -> torch.Tensor:
        return self._get(where, self._where(where, slots, pages))

    def _get(self, where: torch.Tensor, index) -> torch.Tensor:
        return where[index] if where.dim() == 4 else self.cache.view(-1)[index]

    def _put(self, where: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, pages: bool = False) -> None:
        self._put_at(where, self._where(where, slots, pages), x)

    def _put_at(self, where: torch.Tensor, index, x: torch.Tensor) -> None:
        if where.dim() == 4:
            where[index] = x.to(where.dtype)
        else:
            self.cache.view(-1)[index] = x.to(self.cache.dtype)

    def _flat(self, block: torch.Tensor, within: torch.Tensor) -> torch.Tensor:
        """Element offsets of ``within`` [n, ...] (offsets inside a block) in blocks ``block`` [n]."""
        return block.view(-1, *[1] * (within.dim() - 1)) * self.block_stride + within


def head_pages(kv_cache: torch.Tensor) -> torch.Tensor:
    """A layer's cache ``[blocks, Hkv, N, C]`` as single-head pages ``[blocks Hkv, 1, N, C]``, page
    ``b * Hkv + h`` head h of block b (``restkv.vllm.heads``): a view of the same memory, which needs
    each block's heads one after the other in it (head-major blocks: the CPU backend's, the GPU
    backends' ``HND``); any other layout raises in one line (a copy would attend stale entries)."""
    blocks, heads = kv_cache.shape[:2]
    if heads > 1 and kv_cache.stride(0) != heads * kv_cache.stride(1):
        raise ValueError(
            f"restkv.vllm: a KV cache {tuple(kv_cache.shape)} with strides {kv_cache.stride()} is not head-major "
            "within a block (HND): its heads cannot be seen as single-head pages"
        )
    page = kv_cache.stride(1) if heads > 1 else kv_cache.stride(0)
    size, stride = (blocks * heads, 1, *kv_cache.shape[2:]), (page, page, *kv_cache.stride()[2:])
    return kv_cache.as_strided(size, stride, kv_cache.storage_offset())


def whole(caches: dict) -> tuple[torch.Tensor, dict]:
    """Every layer's cache ``[blocks, Hkv, N, C]`` (``caches``: layer name -> tensor) as blocks of one
    tensor over the memory they share (vLLM keeps every layer in one allocation, layer after layer, in
    its layer-compact layouts) -> (that tensor, each layer's first block in it). Layers that are not
    blocks of one such tensor (another allocation, shape or stride, a block that is not contiguous, two
    layers overlapping) raise in one line."""
    names = list(caches)
    ref = caches[names[0]]
    step = ref.stride(0)
    base = min(c.storage_offset() for c in caches.values())
    first = {}
    for name, c in caches.items():
        same = (
            c.untyped_storage().data_ptr() == ref.untyped_storage().data_ptr()
            and c.shape[1:] == ref.shape[1:] and c.stride() == ref.stride() and c.dtype == ref.dtype
            and c[0].is_contiguous() and step == c[0].numel() and (c.storage_offset() - base) % step == 0
        )  # fmt: skip
        if not same:
            raise ValueError(
                f"restkv.vllm: layer {name}'s KV cache {tuple(c.shape)} is not blocks of the one allocation the "
                "other layers' are in (vLLM's layer-compact layout): per-head budgets need it"
            )
        first[name] = (c.storage_offset() - base) // step
    spans = sorted((first[n], first[n] + caches[n].shape[0]) for n in names)
    if any(a_end > b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])):
        raise ValueError("restkv.vllm: two layers' KV caches overlap: per-head budgets need each its own blocks")
    blocks = spans[-1][1]
    return ref.as_strided((blocks, *ref.shape[1:]), ref.stride(), base), first


def declared(
    kv_cache: torch.Tensor,
    backend: str,
    heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    head_slots: int | None = None,
    fp8: tuple | None = None,
) -> Paged:
    """A GPU backend's layer: ``kv_cache`` [B, H, N, C] as vLLM hands it to ``backend``.

    ``heads`` (Hkv), ``head_size`` (d): the layer's; ``block_size``: the engine's (N, a kernel
    block, divides it: a block split into kernel blocks numbers its slots alike); ``dtype``: the
    model's; ``head_slots``: H as the backend declares it (vLLM's ``AttentionSpec.num_head_slots``
    after its ``customize_spec``; None: one slot per KV head). The K/V axis:

    - ``head_slots`` None: the last axis, [B, Hkv, N, 2 d], keys ``[..., :d]`` (every backend at
      the model's dtype);
    - ``head_slots`` 2 Hkv: the head axis, [B, 2 Hkv, N, d], keys ``[:, :Hkv]`` (vLLM's
      convention: FlashInfer's NVFP4 page, ``split(num_kv_heads)``, the keys' heads first).

    The two never fit one shape (H = Hkv or 2 Hkv). vLLM's third packing, K and V as two planes of
    Hkv d each (ROCm, b12x: 2 head slots, packed within), has the last-axis shape at Hkv = 2 (told
    apart by its declaration: refused) and the head-axis declaration at Hkv = 1 (ambiguous:
    refused). ``fp8``: an FP8 cache's (float8 type, k_scale, v_scale), its bytes uint8 (or that type)
    in the same pages. Anything else, or another dtype (another quantized cache), is refused in one line.
    """
    where = f"restkv.vllm: {backend}'s KV cache {tuple(kv_cache.shape)} {kv_cache.dtype}"
    if fp8 is None and kv_cache.dtype != dtype:
        raise ValueError(f"{where}: not the model's {dtype} (a quantized KV cache is not read)")
    if fp8 is not None and kv_cache.dtype not in (torch.uint8, fp8[0]):
        raise ValueError(f"{where}: not the bytes of an FP8 cache ({fp8[0]})")
    if head_slots is not None and head_slots == 2 * heads == 2:
        raise ValueError(f"{where}: 2 head slots for 1 KV head are ambiguous (K/V heads or planes)")
    if head_slots not in (None, 2 * heads):
        raise ValueError(f"{where}: {head_slots} head slots for {heads} KV heads are not read")
    axis, page = (3, (heads, 2 * head_size)) if head_slots is None else (1, (2 * heads, head_size))
    shape = tuple(kv_cache.shape)
    if len(shape) != 4 or (shape[1], shape[3]) != page or block_size % shape[2]:
        raise ValueError(
            f"{where}: not [blocks, {page[0]}, a divisor of the block size {block_size}, "
            f"{page[1]}] ({heads} KV heads of size {head_size})"
        )
    kv_cache = kv_cache if fp8 is None else kv_cache.view(fp8[0])
    keys, values = (x.transpose(1, 2) for x in kv_cache.chunk(2, dim=axis))
    return Paged(kv_cache, keys, values, shape[2], scales=None if fp8 is None else fp8[1:])


# (shape of a block, dtype, writer's key, device) -> the key and value maps (their strides, or the
# element maps), per process
_PROBED: dict = {}


def probed(
    kv_cache: torch.Tensor, block_size: int, heads: int, head_size: int, writer, key=None, fp8: tuple | None = None
) -> Paged:
    """A layer whose layout only its cache writer knows.

    ``kv_cache``: the layer's contiguous cache, blocks first; ``writer(cache, keys, values, slots)``
    writes keys, values [n, Hkv, d] into ``slots`` of a cache shaped as ``kv_cache``. The maps are
    found once per block shape, dtype and ``key`` (e.g. the ISA) on a scratch cache of one block.
    ``fp8``: as ``declared``'s (the writer then writes float8 bytes at unit scales).
    """
    if not kv_cache.is_contiguous():
        raise ValueError("restkv.vllm.paged.probed needs a contiguous cache")
    stored = None if fp8 is None else fp8[0]
    found = (tuple(kv_cache.shape[1:]), kv_cache.dtype, stored, key, kv_cache.device)
    if found not in _PROBED:
        maps = _probe(kv_cache, block_size, heads, head_size, writer, stored)
        _PROBED[found] = [_strides(m) or m.to(kv_cache.device) for m in maps]
    kv_cache = kv_cache if stored is None else kv_cache.view(stored)
    keys, values = (_view(kv_cache, m, block_size, heads, head_size) for m in _PROBED[found])
    return Paged(kv_cache, keys, values, block_size, kv_cache[0].numel(), None if fp8 is None else fp8[1:])


def _probe(kv_cache, block_size: int, heads: int, head_size: int, writer, stored=None):
    """(key map, value map): the element of a block's storage where each (offset, head, channel)
    lands, [block_size, Hkv, d] each. Each element's number is written in base-64 digits (1..64,
    small integers every dtype holds exactly, and never the scratch's 0; base 8 into float8 bytes of
    type ``stored``, which hold 1..8 exactly), one writer call per digit, the keys and the values each
    on their own."""
    scratch = torch.zeros((1, *kv_cache.shape[1:]), dtype=kv_cache.dtype)
    base = 64 if stored is None else 8
    size = block_size * heads * head_size
    number = torch.arange(size).view(block_size, heads, head_size)
    zeros = torch.zeros(block_size, heads, head_size, dtype=scratch.dtype if stored is None else torch.float32)
    slots = torch.arange(block_size)
    maps = []
    for kind in range(2):
        landed = torch.zeros(scratch.numel(), dtype=torch.long)
        for digit in range(_digits(size, base)):
            code = (number // base**digit % base + 1).to(zeros.dtype)
            scratch.zero_()
            writer(scratch, *((code, zeros) if kind == 0 else (zeros, code)), slots)
            raw = (scratch if stored is None else scratch.view(stored)).reshape(-1).float().round().long()
            hit = raw > 0
            landed[hit] += (raw[hit] - 1) * base**digit
        element = torch.full((size,), -1, dtype=torch.long)
        where = torch.nonzero(hit).flatten()
        element[landed[where]] = where
        if (element < 0).any() or where.numel() != size:
            raise RuntimeError(
                "restkv.vllm: the cache writer does not place each key and value once"
            )
        maps.append(element.view(block_size, heads, head_size))
    return maps


def _digits(count: int, base: int = 64) -> int:
    digits = 1
    while base**digits < count:
        digits += 1
    return digits


def _strides(element: torch.Tensor) -> tuple | None:
    """(first element, strides of offset, head, channel) when the map [block_size, Hkv, d] is
    strided, else None."""
    base = int(element[0, 0, 0])
    strides = [
        int((element.narrow(axis, 1, 1) - element.narrow(axis, 0, 1)).flatten()[0]) if n > 1 else 0
        for axis, n in enumerate(element.shape)
    ]
    grid = [torch.arange(n) * s for n, s in zip(element.shape, strides)]
    affine = base + grid[0][:, None, None] + grid[1][None, :, None] + grid[2][None, None, :]
    return (base, *strides) if torch.equal(affine, element) else None


def _view(kv_cache: torch.Tensor, found, block_size: int, heads: int, head_size: int) -> torch.Tensor:
    """A strided map as a [blocks, block_size, Hkv, d] view of ``kv_cache``; an element map as is."""
    if isinstance(found, torch.Tensor):
        return found
    base, *strides = found
    size = (kv_cache.shape[0], block_size, heads, head_size)
    return kv_cache.as_strided(size, (kv_cache[0].numel(), *strides), kv_cache.storage_offset() + base)
