"""A small Vision Transformer in numpy, with RANDOM weights, and a dense
cross-attention "neck" whose output is a large activation per image.

**The weights are random** (a fixed seed; timm's initialisation: truncated
normal, std 0.02). No pretrained ViT ships on PyPI without torch, and this
example needs the *cost* and the *shape* of a vision encoder, not its
accuracy: what the serving system sees is the compute per image and the
size of the tensor handed to the next stage. Retrieval quality in the
``multimodal`` example does not depend on the vision weights being trained
(its ground truth is planted, see ``examples/multimodal.py``).

Why the sizes are realistic:

- **Trunk: ViT-Tiny/16** (Touvron et al., DeiT-Ti): 224 x 224 RGB, 16 x 16
  patches -> 196 patch tokens + [CLS], width 192, 12 pre-norm blocks, 3
  heads, MLP 768, GELU. 5.5M parameters, 1.26 G multiply-adds per image.
- **Neck, DPT-style** (Ranftl et al., "Vision Transformers for Dense
  Prediction"): the patch tokens of blocks 3, 6, 9 and 12 are concatenated
  (196 x 768) and projected to the **keys and values of the downstream
  cross-attention** (2 x 1024 wide), then bilinearly upsampled 2x to a
  28 x 28 grid. Precomputing cross-attention keys/values on the vision side
  is what e.g. Llama-3.2-Vision and Flamingo-style models do; PreFLMR's
  vision side likewise hands a dense patch-token map (CLIP ViT-L/14: 256 x
  1024 per layer) to a cross-attention mapping network. 1.6M parameters,
  0.34 G multiply-adds per image.

**Output per image:** ``kv`` float32 (2, 784, 1024): keys and values of the
784 positions of the 28 x 28 map, **6.42 MB per image** (6,422,528 bytes).
For comparison, the hidden states that a ViT-L/14 at 224 px returns with
``output_hidden_states`` are 25 x 257 x 1024 float32 = 26 MB.

Time per call, one BLAS thread, on the shared 2-core AMD EPYC dev machine
(``python examples/models/vit.py``; other jobs were running: load average
4.7, and 8.7 for the second column)::

    batch 1:   57 ms per image     89 ms
    batch 2:   68 ms per image     81 ms
    batch 4:   75 ms per image     95 ms
    batch 8:   75 ms per image     80 ms

Batching does not pay here: every GEMM already has 197 rows per image, so a
CPU runs at the same rate at batch 1; batches only add latency. (On a GPU
it is the other way round.)

Input: uint8 images (n, 224, 224, 3) (HWC, as decoders produce them),
normalised with the ImageNet mean and std.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32) * 255
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32) * 255


@dataclass(frozen=True)
class ViTConfig:
    image: int = 224
    patch: int = 16
    width: int = 192
    depth: int = 12
    heads: int = 3
    mlp: int = 768
    readout: tuple[int, ...] = (3, 6, 9, 12)  # blocks whose patch tokens feed the neck
    kv_dim: int = 1024  # width of the cross-attention keys and of the values
    upsample: int = 2  # 14 x 14 -> 28 x 28
    seed: int = 0

    @property
    def grid(self) -> int:
        return self.image // self.patch

    @property
    def positions(self) -> int:
        return (self.grid * self.upsample) ** 2

    def output_shape(self, n: int = 1) -> tuple[int, ...]:
        return (n, 2, self.positions, self.kv_dim)

    def output_nbytes(self, n: int = 1) -> int:
        return int(np.prod(self.output_shape(n))) * 4


def _trunc_normal(rng: np.random.Generator, shape: tuple[int, ...], std: float = 0.02) -> np.ndarray:
    x = rng.standard_normal(shape, dtype=np.float32)
    np.clip(x, -2.0, 2.0, out=x)
    x *= np.float32(std)
    return x


def _layer_norm(x: np.ndarray, g: np.ndarray, b: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    xc = x - mu
    var = np.einsum("...i,...i->...", xc, xc)[..., None] / np.float32(x.shape[-1])
    xc *= 1.0 / np.sqrt(var + np.float32(eps))
    xc *= g
    xc += b
    return xc


def _gelu(x: np.ndarray) -> np.ndarray:
    # The tanh approximation (numpy has no erf); in place.
    c = np.float32(np.sqrt(2.0 / np.pi))
    t = x * x
    t *= np.float32(0.044715)
    t += 1.0
    t *= x
    t *= c
    np.tanh(t, out=t)
    t += 1.0
    x *= t
    x *= np.float32(0.5)
    return x


def _interp_matrix(n_in: int, n_out: int) -> np.ndarray:
    """(n_out, n_in) bilinear interpolation weights, align_corners=False."""
    m = np.zeros((n_out, n_in), dtype=np.float32)
    for o in range(n_out):
        src = (o + 0.5) * n_in / n_out - 0.5
        src = min(max(src, 0.0), n_in - 1.0)
        lo = int(np.floor(src))
        hi = min(lo + 1, n_in - 1)
        f = src - lo
        m[o, lo] += 1.0 - f
        m[o, hi] += f
    return m


class VisionEncoder:
    """``encoder(images)``: uint8 (n, 224, 224, 3) -> float32 (n, 2, 784,
    1024), the cross-attention keys ``[:, 0]`` and values ``[:, 1]`` of each
    image. ``hidden_states(images)`` gives the trunk's per-block outputs."""

    def __init__(self, config: ViTConfig = ViTConfig()):
        self.config = c = config
        if c.image % c.patch:
            raise ValueError("the image size must be a multiple of the patch size")
        if c.width % c.heads:
            raise ValueError("the width must be a multiple of the number of heads")
        if not all(1 <= r <= c.depth for r in c.readout):
            raise ValueError(f"readout blocks must be in 1..{c.depth}")
        rng = np.random.default_rng([c.seed, 3])
        d, p = c.width, c.patch
        self.patch_w = _trunc_normal(rng, (3 * p * p, d))
        self.patch_b = np.zeros(d, dtype=np.float32)
        self.cls = _trunc_normal(rng, (1, d))
        self.pos = _trunc_normal(rng, (c.grid * c.grid + 1, d))
        self.blocks = []
        for _ in range(c.depth):
            self.blocks.append({
                "ln1_g": np.ones(d, np.float32), "ln1_b": np.zeros(d, np.float32),
                "qkv_w": _trunc_normal(rng, (d, 3 * d)), "qkv_b": np.zeros(3 * d, np.float32),
                "proj_w": _trunc_normal(rng, (d, d)), "proj_b": np.zeros(d, np.float32),
                "ln2_g": np.ones(d, np.float32), "ln2_b": np.zeros(d, np.float32),
                "fc1_w": _trunc_normal(rng, (d, c.mlp)), "fc1_b": np.zeros(c.mlp, np.float32),
                "fc2_w": _trunc_normal(rng, (c.mlp, d)), "fc2_b": np.zeros(d, np.float32),
            })
        self.norm_g, self.norm_b = np.ones(d, np.float32), np.zeros(d, np.float32)
        r = len(c.readout)
        # The neck: one LayerNorm per readout, then one projection to keys and values.
        self.neck_w = _trunc_normal(rng, (r * d, 2 * c.kv_dim), std=float(1.0 / np.sqrt(r * d)))
        self.neck_b = np.zeros(2 * c.kv_dim, dtype=np.float32)
        self.up = _interp_matrix(c.grid, c.grid * c.upsample)

    @property
    def n_params(self) -> int:
        arrays = [self.patch_w, self.patch_b, self.cls, self.pos, self.norm_g, self.norm_b, self.neck_w, self.neck_b]
        return sum(a.size for a in arrays) + sum(a.size for b in self.blocks for a in b.values())

    def patchify(self, images: np.ndarray) -> np.ndarray:
        """uint8 (n, H, W, 3) -> normalised float32 patches (n, 196, 3*16*16)
        in (channel, row, column) order, as a stride-16 convolution reads them."""
        c = self.config
        images = np.asarray(images)
        if images.ndim != 4 or images.shape[1:] != (c.image, c.image, 3):
            raise ValueError(f"images must have shape (n, {c.image}, {c.image}, 3), got {list(images.shape)}")
        n, g, p = images.shape[0], c.grid, c.patch
        x = (images.astype(np.float32) - MEAN) / STD
        x = x.reshape(n, g, p, g, p, 3).transpose(0, 1, 3, 5, 2, 4)
        return x.reshape(n, g * g, 3 * p * p)

    def _block(self, x: np.ndarray, b: dict[str, np.ndarray]) -> np.ndarray:
        c = self.config
        n, t, d = x.shape
        hd = d // c.heads
        h = _layer_norm(x, b["ln1_g"], b["ln1_b"])
        qkv = (h @ b["qkv_w"] + b["qkv_b"]).reshape(n, t, 3, c.heads, hd).transpose(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # (n, heads, t, hd)
        s = q @ k.transpose(0, 1, 3, 2)
        s *= np.float32(1.0 / np.sqrt(hd))
        s -= s.max(-1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(-1, keepdims=True)
        a = (s @ v).transpose(0, 2, 1, 3).reshape(n, t, d)
        x = x + (a @ b["proj_w"] + b["proj_b"])
        h = _layer_norm(x, b["ln2_g"], b["ln2_b"])
        h = _gelu(h @ b["fc1_w"] + b["fc1_b"])
        x += h @ b["fc2_w"] + b["fc2_b"]
        return x

    def hidden_states(self, images: np.ndarray) -> list[np.ndarray]:
        """The embedding and each block's output: depth + 1 arrays (n, 197, width)."""
        c = self.config
        patches = self.patchify(images)
        n = patches.shape[0]
        x = np.empty((n, c.grid * c.grid + 1, c.width), dtype=np.float32)
        x[:, 0] = self.cls
        x[:, 1:] = patches @ self.patch_w + self.patch_b
        x += self.pos
        states = [x]
        for b in self.blocks:
            x = self._block(x, b)
            states.append(x)
        return states

    def __call__(self, images: np.ndarray) -> np.ndarray:
        c = self.config
        states = self.hidden_states(images)
        n, g, s = states[0].shape[0], c.grid, c.grid * c.upsample
        # Neck: normalised patch tokens of the readout blocks, side by side -> keys and values.
        feats = np.concatenate(
            [_layer_norm(states[r][:, 1:], self.norm_g, self.norm_b) for r in c.readout], axis=-1
        )  # (n, 196, 4 * width)
        kv = feats @ self.neck_w + self.neck_b  # (n, 196, 2 * kv_dim)
        # Bilinear 2x upsampling, separably: rows, then columns.
        kv = kv.reshape(n, g, g * 2 * c.kv_dim)
        kv = np.matmul(self.up, kv).reshape(n * s, g, 2 * c.kv_dim)  # (n*28, 14 cols, 2*kv)
        kv = np.matmul(self.up, kv)  # (n*28, 28, 2*kv)
        out = np.empty(c.output_shape(n), dtype=np.float32)
        kv = kv.reshape(n, s * s, 2, c.kv_dim)
        out[:, 0] = kv[:, :, 0]
        out[:, 1] = kv[:, :, 1]
        return out


def time_batches(sizes: tuple[int, ...] = (1, 2, 4, 8), repeat: int = 3) -> dict[int, float]:
    """Median ms of one encoder call per batch size."""
    enc = VisionEncoder()
    rng = np.random.default_rng(0)
    out = {}
    for b in sizes:
        images = rng.integers(0, 256, size=(b, 224, 224, 3), dtype=np.uint8)
        enc(images)
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            enc(images)
            times.append(time.perf_counter() - t0)
        out[b] = float(np.median(times) * 1e3)
    return out


if __name__ == "__main__":
    t0 = time.perf_counter()
    e = VisionEncoder()
    print(f"built in {time.perf_counter() - t0:.2f} s: {e.n_params / 1e6:.2f}M parameters, "
          f"output {e.config.output_shape()} float32 = {e.config.output_nbytes() / 1e6:.2f} MB per image")
    for b, ms in time_batches().items():
        print(f"batch {b}: {ms:7.1f} ms per batch, {ms / b:6.1f} ms per image")
