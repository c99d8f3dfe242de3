"""The lm-evaluation-harness bridge: lm-eval (the real library, `pip install lm-eval`) drives the server through
its own OpenAI-compatible model types, as it would any vLLM or OpenAI endpoint (docs/evaluation.md).

- Log-likelihood tasks (multiple choice, cloze, rolling perplexity) run through `local-completions`: token ids
  in, `/v1/completions` with `echo` and prompt `logprobs`, the continuation's log-probabilities summed. The
  tokenizer is the server's own, through vLLM's `/tokenize` endpoints (`tokenizer_backend=remote`), so no
  Hugging Face tokenizer is needed.
- Generation tasks run through `local-chat-completions` with lm-eval's chat templating, so the server renders
  K3's chat template.

k3 bundles small task definitions with local data (`k3/eval/tasks/`: multiple choice, cloze, generate-until);
any task lm-eval knows, or a folder of the user's own YAML (`include_path`), runs the same way.

`InProcessLM` is the reference beside the server path: lm-eval's own request building, scored in this process
by `k3.infer.score.PromptScorer` on the model. The tests check that lm-eval's accuracy through the server equals
it item for item.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from pathlib import Path
from typing import Any

from k3.eval.endpoint import Endpoint

TASKS_DIR = Path(__file__).parent / "tasks"
BUNDLED_TASKS = tuple(sorted(p.stem for p in TASKS_DIR.glob("k3_*.yaml")))
LOGLIKELIHOOD_TYPES = ("loglikelihood", "multiple_choice", "loglikelihood_rolling")


def require_lm_eval():
    try:
        import lm_eval
    except ImportError:
        raise ValueError("lm-evaluation-harness is not installed: pip install 'k3[eval]' (or pip install lm-eval)")
    return lm_eval


def task_manager(include_path: str | None = None, defaults: bool = True):
    """lm-eval's TaskManager over k3's bundled tasks, `include_path` (a folder of YAML) and, with `defaults`,
    lm-eval's own; built once per folder (indexing lm-eval's thousands of task files takes seconds)."""
    return _task_manager(str(Path(include_path).resolve()) if include_path else None, defaults)


@functools.cache
def _task_manager(include_path: str | None, defaults: bool):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=[str(TASKS_DIR)] + ([include_path] if include_path else []),
                       include_defaults=defaults)


def output_types(names: list[str], manager) -> dict[str, set[str]]:
    """Each task's output types (a group's: its members'), so a task runs through the model type it needs."""
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise ValueError(f"unknown lm-eval tasks {unknown}; bundled: {list(BUNDLED_TASKS)} (pass --include-path for "
                         "a folder of your own task YAML)")

    with _quiet():
        return {name: {t.OUTPUT_TYPE for t in manager.load(name)["tasks"].values()} for name in names}


class _DropCustomDatasetNotice(logging.Filter):
    """lm-eval warns, for every task with a `custom_dataset` (the bundled tasks' local data), that kwargs can be
    passed to it; nothing to act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed" not in record.getMessage()


logging.getLogger("lm_eval.api.task").addFilter(_DropCustomDatasetNotice())


@contextlib.contextmanager
def _quiet():
    """lm-eval logs every task it indexes at INFO; keep warnings only while it loads."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def model_args(endpoint: Endpoint, generate: bool, num_concurrent: int, batch_size: int) -> dict[str, Any]:
    """lm-eval's `model_args` for the server: `local-completions` (log-likelihoods, remote tokenizer) or
    `local-chat-completions` (generation)."""
    args: dict[str, Any] = {"model": endpoint.model_name, "num_concurrent": num_concurrent, "max_retries": 3,
                            "timeout": 3600}
    if endpoint.max_context:
        args["max_length"] = endpoint.max_context
    if endpoint.api_key:
        args["header"] = {"Authorization": f"Bearer {endpoint.api_key}"}
        args["auth_token"] = endpoint.api_key
    if generate:
        args |= {"base_url": f"{endpoint.url}/v1/chat/completions", "tokenizer_backend": None}
    else:
        args |= {"base_url": f"{endpoint.url}/v1/completions", "tokenizer_backend": "remote",
                 "batch_size": batch_size}
    return args


def run_lm_eval(endpoint: Endpoint, tasks: list[str], *, limit: int | None = None, num_fewshot: int | None = None,
                include_path: str | None = None, num_concurrent: int = 4, batch_size: int = 16,
                log_samples: bool = False, seed: int = 1234) -> dict[str, Any]:
    """Run lm-eval tasks against the server. -> {"results": {task: {metric: value}}, "samples": {task: [...]}
    (with log_samples), "n": {task: items}, "config": ...}."""
    lm_eval = require_lm_eval()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # bundled tasks are local; never wait on the hub
    manager = task_manager(include_path, defaults=False)
    if any(t not in manager.all_tasks for t in tasks):
        manager = task_manager(include_path)  # index lm-eval's own tasks only when one of them is named
    kinds = output_types(tasks, manager)
    mixed = [t for t in tasks if len(kinds[t] & set(LOGLIKELIHOOD_TYPES)) not in (0, len(kinds[t]))]
    if mixed:
        raise ValueError(f"{mixed} mix log-likelihood and generation tasks; name their members instead")
    groups = {"completions": [t for t in tasks if kinds[t] <= set(LOGLIKELIHOOD_TYPES)],
              "chat": [t for t in tasks if not kinds[t] <= set(LOGLIKELIHOOD_TYPES)]}
    out: dict[str, Any] = {"results": {}, "samples": {}, "n": {}, "model_types": {}}
    for kind, names in groups.items():
        if not names:
            continue
        generate = kind == "chat"
        model = "local-chat-completions" if generate else "local-completions"
        with _quiet():
            res = lm_eval.simple_evaluate(
                model=model, model_args=model_args(endpoint, generate, num_concurrent, batch_size), tasks=names,
                task_manager=manager, limit=limit, num_fewshot=num_fewshot, log_samples=log_samples,
                apply_chat_template=generate, random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                fewshot_random_seed=seed, bootstrap_iters=1000)
        for task, metrics in res["results"].items():
            out["results"][task] = tidy_metrics(metrics)
            out["model_types"][task] = model
        for task, counts in res.get("n-samples", {}).items():
            out["n"][task] = counts.get("effective")
        if log_samples:
            out["samples"].update(res.get("samples", {}))
    return out


def tidy_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """lm-eval's "acc,none" / "acc_stderr,none" / "exact_match,first-integer" → "acc", "acc_stderr",
    "exact_match" (the filter is dropped when there is one)."""
    out = {}
    for key, value in metrics.items():
        if key == "alias" or not isinstance(value, (int, float)):
            continue
        name, _, _ = key.partition(",")
        out[name] = float(value)
    return out


def lm_class():
    """`InProcessLM`, defined on first use so that k3 imports without lm-eval installed."""
    require_lm_eval()
    from lm_eval import utils
    from lm_eval.api.model import TemplateLM

    from k3.infer.score import PromptScorer

    class InProcessLM(TemplateLM):
        """lm-eval's model interface over k3's in-process scoring: the reference for the server path. The
        token-level conventions are those of `local-completions` with the remote tokenizer: text encoded
        without specials, `[BOS]` as the prefix of an empty context."""

        def __init__(self, model, tokenizer, batch_size: int = 32, max_length: int = 2048):
            super().__init__()
            self.scorer = PromptScorer(model)
            self.k3_tokenizer = tokenizer
            self.batch_size = batch_size
            self.max_length = max_length - 1  # as lm-eval's API models: one token kept for generation

        @property
        def eot_token_id(self) -> int:
            return self.k3_tokenizer.document_end_id

        @property
        def prefix_token_id(self) -> int:
            return self.k3_tokenizer.bos_id

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
            return self.k3_tokenizer.encode(string)

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
            prompts, starts = [], []
            for _, context, continuation in requests:
                ids = (context + continuation)[-self.max_length:]
                prompts.append(ids)
                starts.append(len(ids) - len(continuation))
            out = []
            for a in range(0, len(prompts), self.batch_size):
                scores = self.scorer.score(prompts[a : a + self.batch_size], top=1)
                out += [(s.total(start), s.greedy(start)) for s, start in zip(scores, starts[a : a + self.batch_size])]
            return out

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            totals = []
            for (string,) in (r.args for r in requests):
                windows = [(None,) + utils.make_disjoint_window(w) for w in utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length - 1, context_len=1)]
                totals.append(sum(ll for ll, _ in self._loglikelihood_tokens(windows)))
            return totals

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            raise NotImplementedError("InProcessLM scores log-likelihoods only; generation tasks run through the "
                                      "server (local-chat-completions)")

    return InProcessLM
