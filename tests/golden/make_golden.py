"""Build the committed golden pairs and record their traces (run once, from the repository root).

    python tests/golden/make_golden.py            # (re)write tests/golden/traces/*.jsonl from this code
    python tests/golden/make_golden.py --pairs    # also rebuild tests/golden/pairs/ (needs transformers)

The traces are what speculate.py writes for fixed runs on the demo pair and on small random pairs,
with the summary's timing fields removed. `tests/test_golden.py` reruns every case and asserts the
same lines: a change of code shape or of kernels must not change one token or
round, nor a confidence by more than rounding (test_golden.FLOAT_TOLERANCE). Regenerate only for a
deliberate behaviour change, and say so in the commit.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.dirname(HERE)]

PAIRS = os.path.join(HERE, "pairs")
TRACES = os.path.join(HERE, "traces")
DEMO = os.path.join(ROOT, "demo")
TIMING = ("tokens_per_second", "prefill_seconds", "decode_seconds", "compile_seconds")


def p(*parts):
    return os.path.join(PAIRS, *parts)


# name -> speculate.py flags ({pairs} and {demo} are filled in; prompt files live in pairs/).
CASES = {
    "demo_greedy_b1": ["--target", "{demo}/target", "--drafter", "{demo}/drafter", "--prompts-file",
                       "{pairs}/demo_prompts.jsonl", "--max-new-tokens", "48"],
    "demo_greedy_b3": ["--target", "{demo}/target", "--drafter", "{demo}/drafter", "--prompts-file",
                       "{pairs}/demo_prompts.jsonl", "--max-new-tokens", "48", "--batch-size", "3"],
    "demo_threshold_b2": ["--target", "{demo}/target", "--drafter", "{demo}/drafter", "--prompts-file",
                          "{pairs}/demo_prompts.jsonl", "--max-new-tokens", "40", "--batch-size", "2",
                          "--confidence-threshold", "0.7"],
    "demo_hardware_b3": ["--target", "{demo}/target", "--drafter", "{demo}/drafter", "--prompts-file",
                         "{pairs}/demo_prompts.jsonl", "--max-new-tokens", "40", "--batch-size", "3",
                         "--scheduler", "hardware", "--sps-table", "{sps}"],
    "demo_autoregressive_b2": ["--target", "{demo}/target", "--prompts-file", "{pairs}/demo_prompts.jsonl",
                               "--max-new-tokens", "32", "--batch-size", "2"],
    "demo_text_prompt": ["--prompt", "def copyfileobj(fsrc, fdst, length=0):\n", "--max-new-tokens", "32"],
    "random_vanilla_b2": ["--target", "{pairs}/target", "--drafter", "{pairs}/vanilla", "--prompts-file",
                          "{pairs}/random_prompts.jsonl", "--max-new-tokens", "40", "--batch-size", "2"],
    "random_vanilla_threshold": ["--target", "{pairs}/target", "--drafter", "{pairs}/vanilla", "--prompts-file",
                                 "{pairs}/random_prompts.jsonl", "--max-new-tokens", "40", "--batch-size", "3",
                                 "--confidence-threshold", "0.6"],
    "random_gated_b3": ["--target", "{pairs}/target", "--drafter", "{pairs}/gated", "--prompts-file",
                        "{pairs}/random_prompts.jsonl", "--max-new-tokens", "40", "--batch-size", "3"],
    "random_rnn_b1": ["--target", "{pairs}/target", "--drafter", "{pairs}/rnn", "--prompts-file",
                      "{pairs}/random_prompts.jsonl", "--max-new-tokens", "40"],
    "random_zlab_b2": ["--target", "{pairs}/target", "--drafter", "{pairs}/zlab", "--prompts-file",
                       "{pairs}/random_prompts.jsonl", "--max-new-tokens", "40", "--batch-size", "2"],
    "random_chat_text": ["--target", "{pairs}/target", "--drafter", "{pairs}/vanilla", "--prompt",
                         "def hello world", "--max-new-tokens", "30", "--num-samples", "2", "--batch-size", "2"],
}


def flags(name: str, sps: str = "") -> list[str]:
    return [a.replace("{pairs}", PAIRS).replace("{demo}", DEMO).replace("{sps}", sps) for a in CASES[name]]


def normalize(trace_text: str) -> str:
    """The trace with the summary's timing fields dropped (everything else is deterministic)."""
    out = []
    for line in trace_text.splitlines():
        obj = json.loads(line)
        if obj.get("summary"):
            obj = {k: v for k, v in obj.items() if k not in TIMING}
        out.append(json.dumps(obj))
    return "\n".join(out) + "\n"


def build_pairs():
    """The random pairs: a tokenizer-carrying tiny target and one drafter per head and layout."""
    import shutil

    from conftest import IM_END_ID, QWEN3_LIKE_TEMPLATE, build_tokenizer, write_json
    from drafters import make_drafter, make_target

    shutil.rmtree(PAIRS, ignore_errors=True)
    os.makedirs(PAIRS)
    # Near-bigram (so the oracle drafters accept runs of drafts), with the tests' word-level tokenizer,
    # chat template and an EOS id that the target does emit.
    make_target(p("target"), vocab_size=48, attn_scale=0.01, eos_token_id=IM_END_ID, seed=3)
    build_tokenizer(48).save(p("target", "tokenizer.json"))
    write_json(p("target", "tokenizer_config.json"), {"tokenizer_class": "PreTrainedTokenizerFast",
                                                      "chat_template": QWEN3_LIKE_TEMPLATE})
    for name, kw in (("vanilla", dict(markov="vanilla", block_size=4, oracle_scale=3.0, norm_scale=0.1)),
                     ("gated", dict(markov="gated", block_size=5, num_layers=1, oracle_scale=3.0, norm_scale=0.1)),
                     ("rnn", dict(markov="rnn", block_size=3, rank=16, oracle=False)),
                     ("zlab", dict(spelling="zlab", markov=None, confidence=False, confidence_with_markov=False,
                                   block_size=6))):
        make_drafter(p(name), p("target"), **kw)
    with open(p("random_prompts.jsonl"), "w") as f:
        for ids in ([7, 12, 30, 9, 41], [20, 21], [40, 8, 8, 33, 14, 19, 10, 2, 44], [3, 4]):
            f.write(json.dumps({"prompt_ids": ids}) + "\n")
    from scripts.demo_prompts import heldout_prompts

    with open(p("demo_prompts.jsonl"), "w") as f:
        for r in heldout_prompts(4, 24):
            f.write(json.dumps({"prompt_ids": r["prompt_ids"]}) + "\n")


def step_time(b: int) -> float:
    """Hand-chosen seconds per round verifying b tokens: jagged, so the schedule varies round to round."""
    return 0.010 + 0.0004 * b + (0.003 if b % 4 == 3 else 0.0)


def write_sps_table(path: str, batch: int, temperature: float = 0.0):
    """The hardware case's SPS table for this machine's identity keys (the models loaded as speculate.py
    loads them), with `step_time`'s rates."""
    import scheduler
    import speculate
    from support.checkpoint import load_models

    models = load_models(os.path.join(DEMO, "target"), os.path.join(DEMO, "drafter"))
    engine = speculate.Engine(models.target, models.drafter, batch_size=batch, max_seq=64, temperature=temperature,
                              scheduler="hardware")
    rates = [1 / step_time(b) for b in engine.scheduler.profile_points]
    table = dict(scheduler.sps_identity(engine), steps_per_second=rates)
    with open(path, "w") as f:
        json.dump(table, f)


def record(names=None):
    import speculate

    os.makedirs(TRACES, exist_ok=True)
    import torch

    torch.set_num_threads(1)  # as the tests run (the SPS table's identity names the thread count)
    sps = os.path.join(TRACES, "sps.tmp.json")
    write_sps_table(sps, 3)
    for name in names or CASES:
        path = os.path.join(TRACES, name + ".raw")
        rc = speculate.main(flags(name, sps) + ["--trace-file", path])
        assert rc == 0, name
        with open(path) as f:
            text = normalize(f.read())
        os.remove(path)
        with open(os.path.join(TRACES, name + ".jsonl"), "w") as f:
            f.write(text)
        print(f"{name}: {text.count(chr(10))} lines", file=sys.stderr)
    os.remove(sps)


if __name__ == "__main__":
    if "--pairs" in sys.argv:
        build_pairs()
    record([a for a in sys.argv[1:] if not a.startswith("--")] or None)
