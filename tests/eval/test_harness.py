"""lm-evaluation-harness through the server: on the bundled tasks, lm-eval's numbers through `local-completions`
(echo + prompt logprobs) equal k3's in-process scoring of the same items (`InProcessLM`), item by item; the
generation task runs through `local-chat-completions`; the bundled data is well formed."""

from __future__ import annotations

import json

import pytest

from k3.eval.harness import (
    BUNDLED_TASKS,
    TASKS_DIR,
    lm_class,
    output_types,
    run_lm_eval,
    task_manager,
    tidy_metrics,
)

lm_eval = pytest.importorskip("lm_eval")


def test_bundled_task_data_is_well_formed():
    assert set(BUNDLED_TASKS) == {"k3_arithmetic", "k3_python_cloze", "k3_python_mc"}
    for line in (TASKS_DIR / "python_mc.jsonl").read_text().splitlines():
        item = json.loads(line)
        assert len(item["choices"]) == 4 and 0 <= item["answer"] < 4
        # no choice is a prefix of another (a prefix would win on its raw log-likelihood for free)
        for a in item["choices"]:
            assert not any(b != a and b.startswith(a) for b in item["choices"]), item
    for line in (TASKS_DIR / "python_cloze.jsonl").read_text().splitlines():
        assert json.loads(line)["target"]
    for line in (TASKS_DIR / "arithmetic.jsonl").read_text().splitlines():
        item = json.loads(line)
        a, op, b = item["question"].split("?")[0].split()[2:5]
        assert int(item["answer"]) == eval(f"{a} {op} {b}")


def per_item(samples):
    """lm-eval's logged samples -> {doc_id: [(loglikelihood, is_greedy) per request]}."""
    return {s["doc_id"]: [tuple(r[0]) if isinstance(r[0], (list, tuple)) else r for r in s["resps"]]
            for s in samples}


@pytest.mark.parametrize("task", ["k3_python_mc", "k3_python_cloze"])
def test_server_path_equals_in_process_scoring(endpoint, model, tokenizer, task):
    served = run_lm_eval(endpoint, [task], log_samples=True, num_concurrent=2, batch_size=8)
    assert served["model_types"][task] == "local-completions"
    reference = lm_eval.simple_evaluate(model=lm_class()(model, tokenizer), tasks=[task],
                                        task_manager=task_manager(defaults=False), log_samples=True,
                                        bootstrap_iters=0)
    ref = tidy_metrics(reference["results"][task])
    got = served["results"][task]
    assert served["n"][task] == {"k3_python_mc": 40, "k3_python_cloze": 30}[task]
    for metric in (("acc", "acc_norm") if task == "k3_python_mc" else ("acc", "perplexity")):
        assert got[metric] == pytest.approx(ref[metric], rel=1e-3, abs=1e-6), metric
    a, b = per_item(served["samples"][task]), per_item(reference["samples"][task])
    assert a.keys() == b.keys()
    for doc in a:
        for (ll_a, greedy_a), (ll_b, greedy_b) in zip(a[doc], b[doc]):
            assert ll_a == pytest.approx(ll_b, abs=1e-3) and greedy_a == greedy_b


def test_generation_task_through_chat_completions(endpoint):
    out = run_lm_eval(endpoint, ["k3_arithmetic"], limit=4, log_samples=True, num_concurrent=2)
    assert out["model_types"]["k3_arithmetic"] == "local-chat-completions"
    assert 0.0 <= out["results"]["k3_arithmetic"]["exact_match"] <= 1.0 and out["n"]["k3_arithmetic"] == 4
    sample = out["samples"]["k3_arithmetic"][0]
    assert sample["target"] and isinstance(sample["resps"][0][0], str)


def test_unknown_task_is_a_clear_error():
    # the bundled-only index: run_lm_eval indexes lm-eval's own tasks (seconds) before it refuses a name
    with pytest.raises(ValueError, match="unknown lm-eval tasks"):
        output_types(["no_such_task_here"], task_manager(defaults=False))
