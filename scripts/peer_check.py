#!/usr/bin/env python3
"""Compare Tandem with llama.cpp on one GGUF file: tokenization and greedy decoding.

A measuring instrument (it needs ../shared/peer's llama-cpp-python), not a test. Tandem's side
comes from `cargo run --release -p tandem-engine --example greedy -- MODEL TEXTS.json OUT.json`;
this script runs llama.cpp on the same texts and reports:

- tokenization: texts whose ids differ (llama.cpp: add BOS as the model says, special tokens
  parsed);
- greedy: for each text, the steps both agree on, Tandem's first near-tie (the top-2 logit margin
  below --margin) and where the two first differ; a text passes when they agree up to the first
  near-tie (or all the way);
- logits: over the agreed steps, the largest |Tandem − llama.cpp| among Tandem's eight highest
  logits, and the largest relative to the step's logit spread.

    PY=$(../shared/peer/setup.sh)
    $PY scripts/peer_check.py MODEL TEXTS.json TANDEM.json [--margin 0.5] [--json OUT]
"""
import argparse
import json
import sys

import numpy as np
from llama_cpp import Llama


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("texts")
    ap.add_argument("tandem")
    ap.add_argument("--margin", type=float, default=0.5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    texts = json.load(open(a.texts))
    ours = json.load(open(a.tandem))
    assert [o["text"] for o in ours] == texts, "the Tandem output is for other texts"
    greedy = any(o["greedy"] for o in ours)
    llm = Llama(model_path=a.model, n_ctx=512, n_threads=a.threads, logits_all=True,
                vocab_only=not greedy, verbose=False)
    report = {"model": a.model, "texts": len(texts), "token_mismatches": [], "greedy": []}
    for o in ours:
        theirs = llm.tokenize(o["text"].encode(), add_bos=True, special=True)
        if list(theirs) != o["ids"]:
            report["token_mismatches"].append({"text": o["text"], "tandem": o["ids"],
                                               "llama.cpp": list(theirs)})
        if not o["greedy"]:
            continue
        llm.reset()
        llm.eval(o["ids"])
        agree, first_diff, worst_abs, worst_rel = 0, None, 0.0, 0.0
        tie = next((i for i, m in enumerate(o["margin"]) if m < a.margin), None)
        for step, tok in enumerate(o["greedy"]):
            row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
            theirs_tok = int(np.argmax(row))
            ids = [t for t, _ in o["top"][step]]
            mine = np.array([v for _, v in o["top"][step]], dtype=np.float32)
            diff = np.abs(mine - row[ids])
            spread = float(row.max() - row.min()) or 1.0
            worst_abs = max(worst_abs, float(diff.max()))
            worst_rel = max(worst_rel, float(diff.max()) / spread)
            if theirs_tok != tok:
                first_diff = step
                break
            agree += 1
            llm.eval([tok])
        ok = first_diff is None or (tie is not None and first_diff >= tie)
        report["greedy"].append({"text": o["text"][:40], "steps": len(o["greedy"]),
                                 "agree": agree, "first_near_tie": tie,
                                 "first_difference": first_diff, "pass": ok,
                                 "max_abs_logit_diff": worst_abs,
                                 "max_rel_logit_diff": worst_rel})
    print(f"tokenization: {len(texts) - len(report['token_mismatches'])}/{len(texts)} texts "
          f"give the same ids")
    for m in report["token_mismatches"]:
        print(f"  differ: {m['text']!r}\n    tandem    {m['tandem']}\n    llama.cpp {m['llama.cpp']}")
    for g in report["greedy"]:
        print(f"  greedy {g['text']!r:44} agree {g['agree']:3}/{g['steps']:3} near-tie "
              f"{g['first_near_tie']} differ {g['first_difference']} max|Δlogit| "
              f"{g['max_abs_logit_diff']:.4f} ({g['max_rel_logit_diff']:.2e} of the spread) "
              f"{'pass' if g['pass'] else 'FAIL'}")
    if a.json:
        json.dump(report, open(a.json, "w"), indent=1)
    failed = report["token_mismatches"] or not all(g["pass"] for g in report["greedy"])
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
