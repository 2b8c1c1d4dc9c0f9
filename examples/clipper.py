"""Model selection from feedback, straggler-bounded ensembles and a
prediction cache (Clipper's selection layer: Crankshaw et al., "Clipper:
A Low-Latency Online Prediction Serving System", NSDI 2017), on four real
scikit-learn classifiers of handwritten digits.

    .venv/bin/slipstream serve examples/clipper.py
    .venv/bin/python examples/clipper_client.py --url http://127.0.0.1:8000 -n 2000
    .venv/bin/python examples/clipper_client.py --pipeline digits_exp4 -n 2000 --degrade svm:1000
    curl localhost:8000/v1/pipelines/digits_exp3/select        # the policy's weights

Why: no single model is best everywhere or for ever. A model can be
retrained into a worse one, its input distribution can drift, a user may
write digits another model reads better. Clipper puts a selection layer
over several deployed models that learns from the true labels fed back
after the answers, so the application need not pick one, and keeps
learning when a model degrades. Its ensemble answers at a deadline with
the models that have answered, so one slow model does not make every
answer slow, and its cache answers repeated queries without running a
model.

The models (``models/digits.py``; trained at first start, ~2 s, and
pickled under ``<data>/clipper/``): an RBF SVM (test accuracy 0.988),
logistic regression (0.963), k-NN with k = 25 (0.949) and a small random
forest (0.870), all trained on one fixed half of scikit-learn's
``load_digits``; the other half (899 images) is the query stream. Each
candidate component serves the store object ``/models/digits/<name>``
(seeded from the pickle), so a new version can be put while it serves:
``slipstream put /models/digits/svm file.pkl``, or the client's
``--degrade svm:N``, which puts the SVM with its labels scrambled by a
fixed permutation after N queries.

Inputs: ``x`` float32 (rows, 64): 8x8 images, pixel values 0-16; the
context pipeline also takes ``user`` string (rows,).

Candidate stages ``LR``, ``RF``, ``SVM``, ``KNN``: ``x`` -> ``label`` int64
(rows,) and ``proba`` float32 (rows, 10).

Pipelines (``CLIPPER_PIPELINES`` picks which are served; each pipeline
runs its own replicas of the candidates):

- ``digits_exp3``: ``ss.Select([LR, RF, SVM, KNN], policy="exp3")``: one
  model per request, drawn by Exp3 from weights learned from feedback.
- ``digits_exp4``: ``policy="exp4"``: all four run, their probabilities
  are combined with learned weights; the answer goes out ``CLIPPER_WAIT_MS``
  after the candidates are dispatched with what has arrived (the straggler
  bound).
- ``digits_exp4_all``: the same ensemble without a bound of its own (it
  waits for every model, up to its 2 s deadline): the comparison for the
  straggler bound.
- ``digits_ctx``: Exp3 with one policy state per ``user`` (Clipper's
  contextualization).
- ``digits_cached``: the ``CLIPPER_CACHED`` model alone, its answers
  cached per input (``cache=True``); ``digits_single``: the same model
  without the cache, for comparison.

Outputs of the selecting pipelines: ``label`` int64 (rows,),
``confidence`` float32 (rows,) (weighted agreement of the models that
answered), ``contributors`` int32 (rows,), ``model`` string (rows,) (the
chosen candidate, or ``ensemble``). Every answer carries the header
``x-slipstream-request-id``; feedback is
``POST /v1/pipelines/<name>/feedback {"request_id": id, "label": y}``
(``client.feedback(...)``); see docs/clipper.md.

Environment variables (read when the app is loaded, by the server and each worker):
- ``SLIPSTREAM_DATA``: the data directory (default ``<repo>/data``).
- ``CLIPPER_PIPELINES``: which pipelines to serve, comma-separated, without
  the ``digits_`` prefix (default all: ``exp3,exp4,exp4_all,ctx,cached,single``).
- ``CLIPPER_SLO_MS``: the p99 objective of the interactive pipelines (default 100).
- ``CLIPPER_WAIT_MS``: ``digits_exp4``'s straggler bound (default 20).
- ``CLIPPER_CACHED``: the model of ``digits_cached`` and ``digits_single``
  (default ``svm``, the costliest per call: ~4 ms on this machine).
- ``CLIPPER_SLOW``: make models slow at random, ``name:share:ms[,...]``:
  ``knn:0.1:200`` sleeps 200 ms in 10% of KNN's batches (a straggler:
  a model on a busy or failing machine). Drawn from a fixed seed per model.
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

import slipstream as ss

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import digits  # noqa: E402

ALL = ("exp3", "exp4", "exp4_all", "ctx", "cached", "single")


def env_list(name: str, default: str) -> list[str]:
    return [p.strip() for p in os.environ.get(name, default).split(",") if p.strip()]


SERVE = set(env_list("CLIPPER_PIPELINES", ",".join(ALL)))
if SERVE - set(ALL):
    raise ss.ConfigError(f"CLIPPER_PIPELINES: unknown {', '.join(sorted(SERVE - set(ALL)))}; "
                         f"the pipelines are {', '.join(ALL)}")
SLO_MS = float(os.environ.get("CLIPPER_SLO_MS", "100"))
WAIT_MS = float(os.environ.get("CLIPPER_WAIT_MS", "20"))
CACHED = os.environ.get("CLIPPER_CACHED", "svm")
if CACHED not in digits.MODELS:
    raise ss.ConfigError(f"CLIPPER_CACHED must be one of {', '.join(digits.MODELS)}, not {CACHED!r}")


def parse_slow(text: str) -> dict[str, tuple[float, float]]:
    """``"knn:0.1:200,rf:0.05:50"`` -> ``{"knn": (0.1, 0.2), "rf": (0.05, 0.05)}``
    (share of batches, seconds)."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            name, share, ms = part.split(":")
            share_f, ms_f = float(share), float(ms)
        except ValueError:
            raise ss.ConfigError(f"CLIPPER_SLOW takes name:share:ms entries, not {part!r}") from None
        if name not in digits.MODELS or not 0 <= share_f <= 1 or ms_f < 0:
            raise ss.ConfigError(f"CLIPPER_SLOW: {part!r}: the name is one of {', '.join(digits.MODELS)}, "
                                 "the share in [0, 1], the delay >= 0 ms")
        out[name] = (share_f, ms_f / 1e3)
    return out


SLOW = parse_slow(os.environ.get("CLIPPER_SLOW", ""))
# The models are trained (once) wherever the app is first loaded: the
# server, before its workers start, or a test that imports this file.
MODEL_FILES = digits.ensure_models()

X = {"x": ss.Tensor("float32", (-1, digits.N_FEATURES))}
OUT = {"label": ss.Tensor("int64", (-1,)), "proba": ss.Tensor("float32", (-1, digits.N_CLASSES))}


class Classifier:
    """A digits model served from its store object: ``x`` -> ``label``, ``proba``.
    Subclasses name the model (``which``)."""

    which = ""

    def __init__(self, model: ss.Object) -> None:
        self.model = digits.load(model.memoryview())
        self.version = model.version
        share, delay = SLOW.get(self.which, (0.0, 0.0))
        self.slow_share, self.slow_s = share, delay
        self.rng = random.Random(f"clipper-slow-{self.which}")

    def __call__(self, batch: ss.Batch) -> dict:
        if self.slow_share and self.rng.random() < self.slow_share:
            time.sleep(self.slow_s)
        label, proba = digits.predict(self.model, batch["x"])
        return {"label": label, "proba": proba}


def needs(which: str) -> dict[str, str]:
    return {"model": digits.key(which)}


@ss.component(max_batch_size=32, inputs=X, outputs=OUT, needs=needs("lr"))
class LR(Classifier):
    """Logistic regression on standardised pixels."""

    which = "lr"


@ss.component(max_batch_size=32, inputs=X, outputs=OUT, needs=needs("rf"))
class RF(Classifier):
    """A small random forest (8 trees of depth 5)."""

    which = "rf"


@ss.component(max_batch_size=32, inputs=X, outputs=OUT, needs=needs("svm"))
class SVM(Classifier):
    """An RBF SVM with calibrated probabilities."""

    which = "svm"


@ss.component(max_batch_size=32, inputs=X, outputs=OUT, needs=needs("knn"))
class KNN(Classifier):
    """k-nearest neighbours, k = 25."""

    which = "knn"


CANDIDATES = [LR, RF, SVM, KNN]


@ss.component(max_batch_size=32, inputs=X, outputs=OUT, needs=needs(CACHED), cache=True)
class Cached(Classifier):
    """The ``CLIPPER_CACHED`` model, its answers cached per input image."""

    which = CACHED


@ss.component(max_batch_size=32, inputs=X, outputs=OUT, needs=needs(CACHED))
class Single(Classifier):
    """The same model without a cache."""

    which = CACHED


SEED = {digits.key(n): p for n, p in MODEL_FILES.items()}
# One real image (from the training half, so never one of the stream's
# queries): what the node primes every stage with before it is ready.
EXAMPLE = {"x": digits.split().x_train[:1].tolist()}
SLO = ss.SLO(p99_ms=SLO_MS)


def serving(name: str) -> bool:
    return name in SERVE


digits_exp3 = ss.Pipeline("digits_exp3", ss.Select(CANDIDATES, policy="exp3"), inputs=X, slo=SLO,
                          example=EXAMPLE, seed=SEED) if serving("exp3") else None
digits_exp4 = ss.Pipeline("digits_exp4", ss.Select(CANDIDATES, policy="exp4", wait_ms=WAIT_MS), inputs=X,
                          slo=SLO, example=EXAMPLE, seed=SEED) if serving("exp4") else None
digits_exp4_all = ss.Pipeline("digits_exp4_all", ss.Select(CANDIDATES, policy="exp4"), inputs=X,
                              slo=ss.SLO(p99_ms=2000), example=EXAMPLE, seed=SEED) if serving("exp4_all") else None
CTX_INPUTS = {**X, "user": ss.Tensor("string", (-1,))}
digits_ctx = ss.Pipeline("digits_ctx", ss.Select(CANDIDATES, policy="exp3", context="user"), inputs=CTX_INPUTS,
                         slo=SLO, example={**EXAMPLE, "user": ["example"]}, seed=SEED) if serving("ctx") else None
digits_cached = ss.Pipeline("digits_cached", Cached, slo=SLO, example=EXAMPLE,
                            seed=SEED) if serving("cached") else None
digits_single = ss.Pipeline("digits_single", Single, slo=SLO, example=EXAMPLE,
                            seed=SEED) if serving("single") else None
