"""The CUDA path of `jinsum.graphs.knn`: each row block's column range from the batch vector, then one hand-written
Triton kernel (`jinsum.kernels.knn_kernel`, see its module for the design), launched by `_launch`.

`knn` is what `jinsum.graphs.knn` calls when the kernel can run (`usable`): a `lax.platform_dependent` of the kernel
on CUDA and the caller's tiled XLA path (`reference`) everywhere else, so the choice is made when the program is
lowered for its device. Under `vmap` the launch's `custom_vmap` rule lays the batch entries end to end, each padded
to whole row blocks, with each block's column range shifted into its entry, and launches once (`_kernel_call`).
The positions are read through `stop_gradient`: neighbours are integers, and `jax.grad` of a step that rebuilds its
graph (DGCNN) must not try to differentiate the kernel.

Column ranges (`column_ranges`). PyG's `batch` vector is sorted: an element's points are consecutive. Then the
rows of a block belong to elements `lo..hi`, and their neighbours lie in `[first point of lo, last point of hi]`,
found by a binary search (`jnp.searchsorted`, unrolled: its default is a while loop of one small step per level)
in the running maximum of `batch` (which leaves padding points, negative, inside the range of the element before
them). Whether the batch is sorted is checked on the device in the same pass: where it is not, every block scans
all the columns, as the XLA path does, so results never depend on the order; only time does.

Within `jinsum._lowering._launch.interpreted()` the same launch runs in Triton's interpreter on CPU (a host
callback), which is how tests run `jinsum.graphs.knn`'s kernel path, vmap rule included, without a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from jinsum import _config
from jinsum._lowering import _launch

# Neighbours per point the kernel keeps in registers (a (block_m, next power of two) int64 tile); past this, the
# XLA path. Indices are packed into 31 bits below the kernel's empty keys.
MAX_K = 128
MAX_POINTS = (1 << 31) - 256
KERNEL_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))
# Below this many coordinates distances are sums of squared differences, on the kernel and the XLA path alike:
# equal points are at bit-equal distances, so their ties go to the lower index on any machine. From here on,
# |x|^2 + |y|^2 - 2 x.y through one matrix product, whose rounding depends on the product's implementation.
DIFFERENCES_BELOW = 16


@dataclasses.dataclass(frozen=True)
class KnnConfig:
    """Launch parameters of the kNN kernel. Rows are the fast axis of its tiles: with `block_m = 32 num_warps`
    each thread owns a row, with one warp and `block_m` 8 or 16 a row spans 4 or 2 lanes (other shapes work, but
    reduce across warps). `direct`: distances as sums of squared differences, else `|x|^2 + |y|^2 - 2 x.y` by
    `tl.dot` (blocks >= 16; None: differences below `DIFFERENCES_BELOW` coordinates); `block_d`: the dot's slice of
    the coordinates (None: `D` rounded up to a power of two, at most 64)."""

    block_m: int = 16
    block_n: int = 32
    num_warps: int = 1
    num_stages: int = 1
    direct: bool | None = None
    block_d: int | None = None


def default_config(dim: int, k: int) -> KnnConfig:
    """The launch parameters for points of `dim` coordinates and `k` neighbours. `JINSUM_KNN_CONFIG` (e.g.
    `block_m=32,block_n=64,num_warps=1`) overrides fields, for sweeps.

    With differences (`D < DIFFERENCES_BELOW`) rows of 16 over one warp and 32 columns a tile; with `tl.dot` 32 x 32
    tiles: the fastest shapes of a sweep (`benchmarks/point_graphs.py --knn-configs`; DESIGN.md, "The kNN kernel")."""
    del k  # (up to MAX_K the same shapes compile: 230-255 registers at k = 128 with rows of 16)
    config = KnnConfig(block_m=16 if dim < DIFFERENCES_BELOW else 32, block_n=32)
    override = os.environ.get("JINSUM_KNN_CONFIG", "")
    if override:
        fields = {f.name for f in dataclasses.fields(KnnConfig)}
        values = {}
        for item in override.split(","):
            key, _, value = (part.strip() for part in item.partition("="))
            if key not in fields:
                raise ValueError(f"JINSUM_KNN_CONFIG: unknown field {key!r} (fields: {', '.join(sorted(fields))})")
            values[key] = {"true": True, "false": False, "none": None}.get(value.lower(), None) \
                if key == "direct" else int(value)
        config = dataclasses.replace(config, **values)
    return config


def _next_power_of_two(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def metaparameters(dim: int, n: int, k: int, loop: bool, config: KnnConfig) -> dict:
    """The kernel's compile-time constants."""
    direct = dim < DIFFERENCES_BELOW if config.direct is None else config.direct
    block_d = config.block_d or min(64, max(16, _next_power_of_two(dim)))
    if not direct and min(config.block_m, config.block_n, block_d) < 16:
        raise ValueError(f"jinsum.graphs.knn: tl.dot needs blocks of at least 16, got {config}")
    return dict(D=dim, K=k, KP=_next_power_of_two(k), LOOP=bool(loop), DIRECT=bool(direct),
                WIDE=n * max(dim, k) >= (1 << 31) - 1, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                BLOCK_D=block_d)


# --- the launch ----------------------------------------------------------------------------------------------------

def _run_kernel(launcher: _launch.Launcher, pos, batch, starts, ends, *, k: int, loop: bool, config: KnnConfig):
    """`(N, k)` neighbours from the kernel, launched by `launcher` (traced arrays, or NumPy in the interpreter)."""
    from jinsum.kernels import knn_kernel  # noqa: PLC0415 (imports triton)

    n, dim = pos.shape
    return launcher.call(knn_kernel, pos, batch, starts, ends, n, out_shape=jax.ShapeDtypeStruct((n, k), jnp.int32),
                         grid=(starts.shape[0],), num_warps=config.num_warps, num_stages=config.num_stages,
                         name="jinsum_knn", **metaparameters(dim, n, k, loop, config))


def usable(pos_dtype, n: int, k: int) -> bool:
    """Whether `knn` may take the kernel path: float32 or half positions, `k <= MAX_K`, and jax-triton (or the
    interpreter), unless `jinsum.triton` is off."""
    if not _config.triton.value or np.dtype(pos_dtype) not in KERNEL_DTYPES:
        return False
    if k > MAX_K or n > MAX_POINTS:
        return False
    return _launch.available(_launch.target())


# --- the call ------------------------------------------------------------------------------------------------------

def knn(pos: jax.Array, batch: jax.Array, *, k: int, loop: bool, reference, config: KnnConfig | None = None):
    """int32 `(N, k)`: `jinsum.graphs.knn(pos, k, batch, loop)` by the kernel on CUDA, by `reference(pos, batch)`
    (same arguments, same result) on other platforms. `batch`: int32 `(N,)`."""
    config = config or default_config(pos.shape[1], k)
    launcher = _launch.target()
    kernel_call = _kernel_call(k, bool(loop), config, launcher)

    def kernel(pos, batch):
        return kernel_call(pos, batch, *column_ranges(batch, config.block_m))

    pos = jax.lax.stop_gradient(pos)
    platform = "cuda" if launcher is _launch.XLA_KERNEL else "cpu"  # (the interpreter: tests on CPU)
    return jax.lax.platform_dependent(pos, batch, default=reference, **{platform: kernel})


@functools.lru_cache(maxsize=64)
def _kernel_call(k: int, loop: bool, config: KnnConfig, launcher: _launch.Launcher):
    """The kernel's launch over `(pos, batch, starts, ends)`, with its vmap rule: the batch entries laid end to
    end as one launch, each padded to whole row blocks, so that no block holds rows of two entries and each
    block's column range (computed per entry, shifted) stays inside its entry. Entries never mix, whatever
    their ids."""

    @jax.custom_batching.custom_vmap
    def kernel(pos, batch, starts, ends):
        return _run_kernel(launcher, pos, batch, starts, ends, k=k, loop=loop, config=config)

    @kernel.def_vmap
    def rule(size, in_batched, pos, batch, starts, ends):
        pos, batch, starts, ends = (x if batched else jnp.broadcast_to(x, (size, *x.shape))
                                    for x, batched in zip((pos, batch, starts, ends), in_batched))
        n = pos.shape[1]
        padded = starts.shape[1] * config.block_m
        if size * padded > MAX_POINTS:  # past the kernel's index width: one launch per entry
            return jax.lax.map(lambda entry: kernel(*entry), (pos, batch, starts, ends)), True
        pos = jnp.pad(pos, ((0, 0), (0, padded - n), (0, 0)))
        batch = jnp.pad(batch, ((0, 0), (0, padded - n)), constant_values=-1)
        first = jnp.arange(size, dtype=jnp.int32)[:, None] * padded
        found = kernel(pos.reshape(size * padded, pos.shape[2]), batch.reshape(-1),  # (nested vmaps: again)
                       (starts + first).reshape(-1), (ends + first).reshape(-1))
        found = found.reshape(size, padded, k)[:, :n]
        return jnp.where(found >= 0, found - first[:, :, None], -1), True

    return kernel


def column_ranges(batch: jax.Array, block_m: int) -> tuple[jax.Array, jax.Array]:
    """int32 `(starts, ends)`, one per block of `block_m` rows: the columns `[start, end)` that hold every point
    of the elements the block's rows belong to (see the module docstring); `(0, 0)` for a block of padding
    points only, `(0, N)` for every other block when the batch is not sorted."""
    n = batch.shape[0]
    blocks = -(-n // block_m)
    batch = batch.astype(jnp.int32)
    running = jax.lax.cummax(batch)  # sorted; equal to batch at every real point iff the batch is sorted
    in_order = jnp.all((batch < 0) | (batch == running))
    tiles = jnp.pad(batch, (0, blocks * block_m - n), constant_values=-1).reshape(blocks, block_m)
    lo = jnp.min(jnp.where(tiles >= 0, tiles, jnp.iinfo(jnp.int32).max), axis=1)
    hi = jnp.max(tiles, axis=1)
    starts = jnp.searchsorted(running, lo, side="left", method="scan_unrolled").astype(jnp.int32)
    ends = jnp.searchsorted(running, hi, side="right", method="scan_unrolled").astype(jnp.int32)
    real = hi >= 0
    starts = jnp.where(real & in_order, starts, 0)
    ends = jnp.where(real, jnp.where(in_order, ends, n), 0)
    return starts, ends


# --- Triton's interpreter (tests) ----------------------------------------------------------------------------------

def interpret_kernel(pos: np.ndarray, batch: np.ndarray, starts: np.ndarray, ends: np.ndarray, *, k: int,
                     loop: bool, config: KnnConfig) -> np.ndarray:
    """The kernel on NumPy arrays in Triton's interpreter on CPU (needs `TRITON_INTERPRET=1` set before Triton
    kernels are first defined, and torch): the same arguments and constants as on a GPU."""
    return _run_kernel(_launch.INTERPRETER, pos, batch.astype(np.int32), starts, ends, k=k, loop=loop, config=config)


def interpret(pos, k: int, batch=None, loop: bool = False, config: KnnConfig | None = None) -> np.ndarray:
    """`jinsum.graphs.knn(pos, k, batch, loop)` by the kernel in Triton's interpreter (tests): column ranges from
    `column_ranges`, then `interpret_kernel`."""
    pos = np.asarray(pos)
    batch = np.zeros(pos.shape[0], np.int32) if batch is None else np.asarray(batch, np.int32)
    config = config or default_config(pos.shape[1], k)
    if pos.shape[0] == 0:
        return np.zeros((0, k), np.int32)
    starts, ends = (np.asarray(x) for x in jax.jit(column_ranges, static_argnums=1)(batch, config.block_m))
    return interpret_kernel(pos, batch, starts, ends, k=k, loop=loop, config=config)
