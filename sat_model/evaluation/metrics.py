"""Caption metrics: the coco-caption scorers of pycocoevalcap, called directly.

``COCOEvalCap.evaluate()`` is not used: it also builds SPICE, which downloads Stanford models
and fails offline. The numbers are pycocoevalcap's own: PTB tokenisation (Java), ``Bleu(4)``,
``Meteor()`` (Java), ``Rouge()`` (ROUGE-L) and ``Cider()`` (CIDEr-D). Validation during training
calls the same :func:`score_captions` with ``metrics=("bleu",)``, so the early-stopping score
and the reported score can never disagree about tokenisation or BLEU variant (docs/METHOD.md,
"Known pitfalls": nltk BLEU reported as if it were coco-caption's).

METEOR runs a Java subprocess spoken to over pipes; a stuck JVM would hang the caller for ever,
so the scoring runs in a thread and the process is killed after ``meteor_timeout_s``
(:class:`MetricTimeoutError`).

Metrics are a registry: ``@register_metric(name, keys, labels=..., direction=...)`` on a scorer
adds one, with what the rest of the code reads about it: its keys (:func:`metric_keys`), how
tables and progress lines label them (:func:`metric_label`), whether higher is better
(:func:`metric_direction`) and whether it is one of the headline scores that short tables show
(:func:`headline_keys`). ``train.monitor`` names a key; evaluation, validation, Tune, ``sat
models``, ``sat summary`` and the docs' results tables read the table.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

from sat_model.registry import Registry

__all__ = [
    "IMAGE_METRICS",
    "MetricError",
    "MetricTimeoutError",
    "ScoringOptions",
    "default_meteor_command",
    "headline_keys",
    "list_metrics",
    "metric_direction",
    "metric_keys",
    "metric_label",
    "metric_of_key",
    "register_metric",
    "score_captions",
    "score_images",
]


@dataclass(frozen=True)
class ScoringOptions:
    meteor_timeout_s: float = 600.0
    meteor_command: Sequence[str] | None = None  # tests simulate a stuck METEOR with it


# PTB-tokenised references and hypotheses, keyed by image id -> {key: score}
Scorer = Callable[[dict[str, list[str]], dict[str, list[str]], ScoringOptions], dict[str, float]]


@dataclass(frozen=True)
class _Metric:
    keys: tuple[str, ...]  # flat, stable keys of metrics.json
    score: Scorer
    labels: Mapping[str, str]  # key -> how tables and progress lines name it ("BLEU-4")
    direction: str  # "max": higher is better; "min": lower is
    headline: bool  # its last key is one of the scores short tables and summary lines show


_METRICS: Registry[_Metric] = Registry("metric", ValueError)


def register_metric(
    name: str,
    keys: Sequence[str],
    *,
    labels: Mapping[str, str] | None = None,
    direction: str = "max",
    headline: bool = True,
) -> Callable[[Scorer], Scorer]:
    """Decorator: add the metric family ``name``, whose scorer returns ``keys``; ``labels``
    names them for people (default: the key), ``direction`` says which way is better and
    ``headline`` whether its last key is shown in short tables (``sat models``, summaries)."""
    if direction not in ("max", "min"):
        raise ValueError(f"direction must be 'max' or 'min', not {direction!r}")

    def add(score: Scorer) -> Scorer:
        entry = _Metric(tuple(keys), score, dict(labels or {}), direction, headline)
        _METRICS.add(name, entry)
        return score

    return add


def _family(key: str) -> _Metric:
    for name in _METRICS:
        if key in _METRICS[name].keys:
            return _METRICS[name]
    raise ValueError(f"{key!r} is not a key of a registered metric; known: {list(metric_keys())}")


def metric_of_key(key: str) -> str:
    """The registered family that reports ``key`` (``bleu_4`` -> ``bleu``)."""
    return next(name for name in _METRICS if _METRICS[name] is _family(key))


def metric_label(key: str) -> str:
    """How people read ``key`` (``BLEU-4``); an unregistered key reads as itself."""
    try:
        return _family(key).labels.get(key, key)
    except ValueError:
        return key


def metric_direction(key: str) -> str:
    """``"max"`` when a higher ``key`` is better, ``"min"`` when a lower one is."""
    return _family(key).direction


def headline_keys() -> tuple[str, ...]:
    """The scores short tables and summary lines show, one per headline family, in order."""
    return tuple(_METRICS[n].keys[-1] for n in _METRICS if _METRICS[n].headline)


def list_metrics() -> list[str]:
    """The registered metric families, in the order they were registered (the report's)."""
    return list(_METRICS)


def metric_keys(names: Sequence[str] | None = None) -> tuple[str, ...]:
    """The flat keys of ``names`` (default: every registered family), in order."""
    return tuple(k for name in (names or list_metrics()) for k in _METRICS[name].keys)


# seconds to wait for a killed METEOR thread to notice its closed pipes
_KILL_GRACE_S = 10.0


class MetricError(RuntimeError):
    """A scorer could not run (no Java, a crashed METEOR process, inputs it cannot score)."""


class MetricTimeoutError(MetricError):
    """METEOR did not answer within its timeout; its Java process has been killed."""


def default_meteor_command() -> list[str]:
    """pycocoevalcap's own METEOR command line (run in the folder holding the jar)."""
    from pycocoevalcap.meteor.meteor import METEOR_JAR

    return ["java", "-jar", "-Xmx2G", METEOR_JAR, "-", "-", "-stdio", "-l", "en", "-norm"]


def score_captions(
    hypotheses: Mapping[str, str],
    references: Mapping[str, Sequence[str]],
    metrics: Sequence[str] | None = None,
    meteor_timeout_s: float = 600.0,
    *,
    meteor_command: Sequence[str] | None = None,
) -> dict[str, float]:
    """Corpus scores of one hypothesis per image against that image's references.

    Both mappings are keyed by image id and must hold the same ids. Returns the flat keys
    (``bleu_1``..``bleu_4``, ``meteor``, ``rouge_l``, ``cider``, ...) of the requested families
    (default: every registered one). ``meteor_command`` replaces the ``java -jar
    meteor-1.5.jar ...`` command line (run in pycocoevalcap's meteor folder).
    """
    metrics = list(metrics or list_metrics())
    _check_inputs(hypotheses, references, metrics)
    gts, res = _ptb_tokenize(hypotheses, references)
    options = ScoringOptions(meteor_timeout_s, meteor_command)
    scores: dict[str, float] = {}
    for name in metrics:
        scores.update(_METRICS[name].score(gts, res, options))
    return scores


# the metrics each image is scored with on its own (the attention gallery shows them): the
# scorers that give per-image values without another process (METEOR runs Java per call)
IMAGE_METRICS = ("bleu_4", "rouge_l", "cider")


def score_images(
    hypotheses: Mapping[str, str], references: Mapping[str, Sequence[str]]
) -> dict[str, dict[str, float]]:
    """Each image's own BLEU-4, ROUGE-L and CIDEr-D (``IMAGE_METRICS``), as pycocoevalcap's
    ``COCOEvalCap`` reports them per image (CIDEr's document frequencies from all images)."""
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge

    _check_inputs(hypotheses, references, ["bleu", "rouge", "cider"])
    gts, res = _ptb_tokenize(hypotheses, references)
    ids = list(gts)  # the order every scorer walks
    columns = {
        "bleu_4": Bleu(4).compute_score(gts, res, verbose=0)[1][3],
        "rouge_l": Rouge().compute_score(gts, res)[1],
        "cider": Cider().compute_score(gts, res)[1],
    }
    return {i: {k: float(v[n]) for k, v in columns.items()} for n, i in enumerate(ids)}


def _check_inputs(
    hypotheses: Mapping[str, str],
    references: Mapping[str, Sequence[str]],
    metrics: Sequence[str],
) -> None:
    unknown = sorted(set(metrics) - set(_METRICS))
    if unknown:
        raise ValueError(f"unknown metric(s) {unknown}; known: {list_metrics()}")
    if not metrics:
        raise ValueError("no metric requested")
    if not hypotheses:
        raise ValueError("no hypotheses to score")
    missing = sorted(set(hypotheses) - set(references))
    extra = sorted(set(references) - set(hypotheses))
    if missing or extra:
        raise ValueError(
            f"hypotheses and references must cover the same images: "
            f"{len(missing)} without references (e.g. {missing[:3]}), "
            f"{len(extra)} without a hypothesis (e.g. {extra[:3]})"
        )
    empty = sorted(k for k, refs in references.items() if len(refs) == 0)
    if empty:
        raise ValueError(f"{len(empty)} image(s) have no reference caption (e.g. {empty[:3]})")
    bad = sorted(k for k, h in hypotheses.items() if not isinstance(h, str))
    if bad:
        raise ValueError(f"hypotheses must be one string per image; not a string: {bad[:3]}")


def _ptb_tokenize(
    hypotheses: Mapping[str, str], references: Mapping[str, Sequence[str]]
) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """pycocoevalcap's ``PTBTokenizer.tokenize`` of the references and of the hypotheses: its
    jar, command line and punctuation filter, one caption per line. Run here rather than
    through ``PTBTokenizer`` so that one JVM does both sets, the captions go in on stdin (not a
    temporary file in the installed package's folder) and the tokenizer's "PTBTokenizer
    tokenized N tokens" line on stderr is kept off the user's terminal; its stderr is part of
    the error when it fails.
    """
    from pycocoevalcap.tokenizer import ptbtokenizer as ptb

    reference_keys = [k for k, v in references.items() for _ in v]
    captions = [c for v in references.values() for c in v] + list(hypotheses.values())
    # one caption per line: a line break inside one would shift every later caption
    text = "\n".join(" ".join(c.splitlines()) for c in captions)
    command = ["java", "-cp", ptb.STANFORD_CORENLP_3_4_1_JAR]
    command += ["edu.stanford.nlp.process.PTBTokenizer", "-preserveLines", "-lowerCase"]
    try:
        done = subprocess.run(
            command,
            cwd=os.path.dirname(os.path.abspath(ptb.__file__)),
            input=text.encode(),
            capture_output=True,
            check=False,
        )
    except FileNotFoundError as e:
        raise MetricError(f"the PTB tokenizer needs Java on PATH: {e}") from e
    lines = done.stdout.decode().split("\n")
    if lines and not lines[-1] and len(lines) == len(captions) + 1:
        lines.pop()  # a final line break
    if done.returncode != 0 or len(lines) != len(captions):
        detail = done.stderr.decode(errors="replace").strip()[-500:]
        raise MetricError(
            f"the PTB tokenizer (exit {done.returncode}) returned {len(lines)} lines for "
            f"{len(captions)} captions: {detail}"
        )
    words = [
        " ".join(w for w in ln.rstrip().split(" ") if w not in ptb.PUNCTUATIONS) for ln in lines
    ]
    gts: dict[str, list[str]] = {}
    for key, caption in zip(reference_keys, words, strict=False):  # the references come first
        gts.setdefault(key, []).append(caption)
    hypothesis_words = words[len(reference_keys) :]
    res = {key: [caption] for key, caption in zip(hypotheses, hypothesis_words, strict=True)}
    return gts, res


@register_metric(
    "bleu",
    ("bleu_1", "bleu_2", "bleu_3", "bleu_4"),
    labels={f"bleu_{n}": f"BLEU-{n}" for n in range(1, 5)},
)
def _bleu(
    gts: dict[str, list[str]], res: dict[str, list[str]], options: ScoringOptions
) -> dict[str, float]:
    from pycocoevalcap.bleu.bleu import Bleu

    score, _ = Bleu(4).compute_score(gts, res, verbose=0)
    return {key: float(s) for key, s in zip(metric_keys(["bleu"]), score, strict=True)}


@register_metric("meteor", ("meteor",), labels={"meteor": "METEOR"})
def _meteor_score(
    gts: dict[str, list[str]], res: dict[str, list[str]], options: ScoringOptions
) -> dict[str, float]:
    command = list(options.meteor_command or default_meteor_command())
    return {"meteor": _meteor(gts, res, command, options.meteor_timeout_s)}


@register_metric("rouge", ("rouge_l",), labels={"rouge_l": "ROUGE-L"}, headline=False)
def _rouge(
    gts: dict[str, list[str]], res: dict[str, list[str]], options: ScoringOptions
) -> dict[str, float]:
    from pycocoevalcap.rouge.rouge import Rouge

    return {"rouge_l": float(Rouge().compute_score(gts, res)[0])}


@register_metric("cider", ("cider",), labels={"cider": "CIDEr"})
def _cider(
    gts: dict[str, list[str]], res: dict[str, list[str]], options: ScoringOptions
) -> dict[str, float]:
    from pycocoevalcap.cider.cider import Cider

    return {"cider": float(Cider().compute_score(gts, res)[0])}


def _meteor_class() -> type:
    from pycocoevalcap.meteor.meteor import Meteor

    class _KillableMeteor(Meteor):  # type: ignore[misc]  # pycocoevalcap is untyped
        """pycocoevalcap's Meteor with a given command line and a close that never blocks.

        Meteor's own ``__del__`` takes the lock that ``compute_score`` holds while it waits on
        the pipe, so after a timeout it would deadlock; ``close`` kills without the lock.
        """

        def __init__(self, command: list[str], cwd: str, stderr: IO[bytes]) -> None:
            self.meteor_cmd = command
            self.lock = threading.Lock()
            self.meteor_p = subprocess.Popen(
                command, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr
            )

        def close(self) -> None:
            if self.meteor_p.poll() is None:
                self.meteor_p.kill()
            self.meteor_p.wait()
            for stream in (self.meteor_p.stdin, self.meteor_p.stdout):
                # a pipe already broken by the kill has nothing left to flush
                with contextlib.suppress(OSError):
                    if stream is not None:
                        stream.close()

        def __del__(self) -> None:
            if hasattr(self, "meteor_p"):
                self.close()

    return _KillableMeteor


def _meteor(
    gts: dict[str, list[str]], res: dict[str, list[str]], command: list[str], timeout_s: float
) -> float:
    from pycocoevalcap.meteor import meteor as meteor_module

    cwd = os.path.dirname(os.path.abspath(meteor_module.__file__))
    with tempfile.TemporaryFile() as stderr:
        try:
            scorer = _meteor_class()(command, cwd, stderr)
        except FileNotFoundError as e:
            raise MetricError(f"cannot start METEOR ({command[0]!r} not found): {e}") from e
        outcome: dict[str, Any] = {}
        worker = threading.Thread(
            target=_run_meteor, args=(scorer, gts, res, outcome), name="meteor", daemon=True
        )
        worker.start()
        worker.join(timeout_s)
        timed_out = worker.is_alive()
        scorer.close()  # on timeout this breaks the worker's pipe read, so the thread ends
        worker.join(_KILL_GRACE_S)
        if timed_out:
            raise MetricTimeoutError(
                f"METEOR timed out after {timeout_s:g} s (command {' '.join(command)!r}); "
                f"its process was killed. Raise eval.meteor_timeout_s if the corpus is large."
            )
        if "error" in outcome:
            stderr.seek(0)
            tail = stderr.read()[-2000:].decode(errors="replace")
            raise MetricError(f"METEOR failed: {outcome['error']!r}; stderr: {tail}") from outcome[
                "error"
            ]
    if "score" not in outcome:
        raise MetricError("METEOR ended without a score")
    return float(outcome["score"])


def _run_meteor(
    scorer: Any, gts: dict[str, list[str]], res: dict[str, list[str]], outcome: dict[str, Any]
) -> None:
    try:
        outcome["score"] = scorer.compute_score(gts, res)[0]
    except (OSError, ValueError) as e:  # a closed/broken pipe or a non-numeric answer
        outcome["error"] = e
