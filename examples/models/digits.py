"""Four scikit-learn classifiers of handwritten digits, for the model
selection demo (``examples/clipper.py``) and its benchmark
(``bench/clipper.py``).

Why these four, and why they differ: Clipper's selection layer is worth
something only when the candidates differ in accuracy, and it should find
the best one from feedback alone. The dataset is ``load_digits`` (1,797
8x8 images, 64 features 0-16, ten classes; it ships inside scikit-learn,
nothing is downloaded), split once 50/50 with a fixed seed, stratified:
898 images train every model, the 899 others are the query stream. On that
split (scikit-learn 1.9):

==========  =================================================  ========
name        model                                              accuracy
==========  =================================================  ========
``svm``     RBF SVM (gamma 0.001, C 10), probabilities from     0.988
            sigmoid calibration on held-out folds
``lr``      logistic regression on standardised pixels, C 0.1   0.963
``knn``     k-nearest neighbours, k = 25 (uniform vote)         0.949
``rf``      a small random forest: 8 trees of depth 5           0.870
==========  =================================================  ========

Two are weakened on purpose, and said so: k = 25 is a smoother
neighbourhood than the usual 5 (0.984 there, too close to the SVM for a
bandit to tell apart in a few thousand queries), and the forest is small
(100 full-depth trees reach 0.973). The others are ordinary settings.

Models are trained when first asked for (about 2 s on two cores) and
pickled under ``<data>/clipper/``; the file name carries the scikit-learn
version and a hash of the hyperparameters, so a change of either trains
again. The app seeds the store keys ``/models/digits/<name>`` from those
files; the components load their model from the store object.

``Scrambled`` is the "degraded" version of a model for the degrade
experiment: the same model, its predicted labels (and probability
columns) mapped through a fixed permutation without fixed points, so it
is confidently wrong on almost every image. ``scrambled_bytes(name)`` is
what to put under the model's key. Store objects are unpickled: only a
writer holding the node's admin token can put them (docs/design/store.md).
"""

from __future__ import annotations

import hashlib
import io
import pickle
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from models import atomic_write_bytes, data_dir

#: The candidates, in the order the app declares them.
MODELS = ("lr", "rf", "svm", "knn")
N_CLASSES = 10
N_FEATURES = 64
KEY_PREFIX = "/models/digits/"
SEED = 0
TEST_SIZE = 0.5


def key(name: str) -> str:
    """The store key a model is served from."""
    check(name)
    return KEY_PREFIX + name


def check(name: str) -> str:
    if name not in MODELS:
        raise ValueError(f"unknown digits model {name!r}; the models are {', '.join(MODELS)}")
    return name


@dataclass(frozen=True)
class Split:
    """The fixed train/test split; ``x_*`` float32 (rows, 64), ``y_*`` int64."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


@lru_cache(maxsize=1)
def split() -> Split:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=TEST_SIZE, random_state=SEED, stratify=y)
    return Split(np.ascontiguousarray(x_tr, np.float32), y_tr.astype(np.int64),
                 np.ascontiguousarray(x_te, np.float32), y_te.astype(np.int64))


def build(name: str) -> Any:
    """An unfitted estimator for ``name`` (see the module docstring)."""
    from sklearn.calibration import CalibratedClassifierCV
    from sklearn.ensemble import RandomForestClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.neighbors import KNeighborsClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    from sklearn.svm import SVC

    check(name)
    if name == "lr":
        return make_pipeline(StandardScaler(), LogisticRegression(C=0.1, max_iter=2000))
    if name == "rf":
        return RandomForestClassifier(n_estimators=8, max_depth=5, random_state=SEED, n_jobs=1)
    if name == "svm":
        # SVC(probability=True) is deprecated from 1.9 on; this is what it
        # recommends instead (Platt scaling fitted on held-out folds).
        return CalibratedClassifierCV(SVC(gamma=0.001, C=10.0), ensemble=False, method="sigmoid")
    return KNeighborsClassifier(n_neighbors=25, n_jobs=1)


def model_path(name: str) -> Path:
    """Where the trained model is pickled: per scikit-learn version and
    hyperparameters (a pickle is only good for the version that wrote it)."""
    import sklearn

    tag = hashlib.sha256(f"{build(name)!r}|{SEED}|{TEST_SIZE}".encode()).hexdigest()[:10]
    return data_dir("clipper") / f"digits-{name}-sklearn{sklearn.__version__}-{tag}.pkl"


def train(name: str) -> Any:
    s = split()
    model = build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.fit(s.x_train, s.y_train)
    return model


def ensure_models(names: tuple[str, ...] = MODELS) -> dict[str, Path]:
    """The pickled model of each name, trained now if it is missing. Safe to
    call from several processes at once (files are written atomically)."""
    out = {}
    for name in names:
        path = model_path(name)
        if not path.is_file():
            atomic_write_bytes(path, pickle.dumps(train(name), protocol=pickle.HIGHEST_PROTOCOL))
        out[name] = path
    return out


def load(buf: bytes | memoryview) -> Any:
    """A model from its pickled bytes (a store object's value)."""
    return pickle.load(io.BytesIO(buf))


def predict(model: Any, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``label`` int64 (rows,) and ``proba`` float32 (rows, 10), the label
    being the most probable class (so the two always agree)."""
    proba = np.asarray(model.predict_proba(x), dtype=np.float32)
    if proba.shape[1] != N_CLASSES:
        raise ValueError(f"a digits model gives {N_CLASSES} class probabilities, this one {proba.shape[1]}")
    return proba.argmax(axis=1).astype(np.int64), proba


def derangement(seed: int = 7) -> np.ndarray:
    """A fixed permutation of the ten labels that moves every label."""
    rng = np.random.default_rng(seed)
    while True:
        p = rng.permutation(N_CLASSES)
        if (p != np.arange(N_CLASSES)).all():
            return p


class Scrambled:
    """A model whose answers are mapped through a fixed label permutation:
    class ``c`` predicted becomes ``perm[c]``, and its probability moves
    with it. The degraded version of a model: as confident as before and
    wrong wherever the model was right."""

    def __init__(self, model: Any, perm: np.ndarray):
        self.model = model
        self.perm = np.asarray(perm, dtype=np.int64)
        self.classes_ = np.arange(N_CLASSES)

    def predict_proba(self, x: np.ndarray) -> np.ndarray:
        p = np.asarray(self.model.predict_proba(x))
        out = np.empty_like(p)
        out[:, self.perm] = p
        return out

    def predict(self, x: np.ndarray) -> np.ndarray:
        return self.predict_proba(x).argmax(axis=1)


def scrambled_bytes(name: str) -> bytes:
    """What to put under ``key(name)`` to degrade that model."""
    model = load(ensure_models((name,))[name].read_bytes())
    return pickle.dumps(Scrambled(model, derangement()), protocol=pickle.HIGHEST_PROTOCOL)


def model_bytes(name: str) -> bytes:
    """The trained model's pickle (to put a model back after a degrade)."""
    return ensure_models((name,))[name].read_bytes()


def query_stream(n: int, seed: int = 1) -> np.ndarray:
    """``n`` indices into the test split: the split in a shuffled order,
    again in a new order once it is used up (a stream longer than 899)."""
    rng = np.random.default_rng(seed)
    m = len(split().y_test)
    return np.concatenate([rng.permutation(m) for _ in range(-(-n // m))])[:n]


def zipf_stream(n: int, s: float = 1.1, seed: int = 2, ranking_seed: int = 3) -> np.ndarray:
    """``n`` indices into the test split, skewed: the image of popularity
    rank ``r`` (a fixed random ranking, from ``ranking_seed``) is drawn with
    probability proportional to ``1 / r**s``, as requests for popular items
    are. ``seed`` draws the stream; two seeds give two streams over the same
    popular images."""
    m = len(split().y_test)
    weights = 1.0 / np.arange(1, m + 1, dtype=np.float64) ** s
    ranking = np.random.default_rng(ranking_seed).permutation(m)
    return ranking[np.random.default_rng(seed).choice(m, size=n, p=weights / weights.sum())]


def accuracies(names: tuple[str, ...] = MODELS) -> dict[str, float]:
    """Each model's accuracy on the whole test split, computed here."""
    s = split()
    return {n: float((predict(load(p.read_bytes()), s.x_test)[0] == s.y_test).mean())
            for n, p in ensure_models(names).items()}


if __name__ == "__main__":
    for n, acc in accuracies().items():
        print(f"{n:4s} {acc:.4f}  {model_path(n)}")
