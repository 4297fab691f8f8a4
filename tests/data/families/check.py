"""transformers on mounted hf/ views against make.py's references.

argv: work_dir label=hf_dir...; a label is a family, or family:what (the
same family's reference for another mount of it).

Prints one line per label: "OK label ..." or "FAIL label: why".
"""
import json, os, sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

work = sys.argv[1]
for arg in sys.argv[2:]:
    label, hf = arg.split("=", 1)
    fam = label.split(":")[0]
    try:
        ref = json.load(open(os.path.join(work, fam + ".ref.json")))
        want = np.fromfile(os.path.join(work, fam + ".logits.f32"), dtype="<f4").reshape(len(ref["tokens"]), -1)
        model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
        ids = torch.tensor([ref["tokens"]])
        with torch.no_grad():
            got = model(ids).logits[0].float().numpy()
            n = len(ref["greedy"])
            greedy = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                    pad_token_id=0)[0, len(ref["tokens"]):].tolist()
        problems = []
        if got.shape != want.shape:
            problems.append(f"logits shape {got.shape} vs {want.shape}")
        else:
            rel = float(np.abs(got - want).max() / np.abs(want).max())
            if not rel <= 1e-4:
                problems.append(f"logits max relative difference {rel:.3g} > 1e-4")
        if greedy != ref["greedy"]:
            problems.append(f"greedy {greedy} vs {ref['greedy']}")
        t = AutoTokenizer.from_pretrained(hf)
        for text, want_ids in zip(ref["texts"], ref["ids"]):
            got_ids = t(text, add_special_tokens=False)["input_ids"]
            if got_ids != want_ids:
                problems.append(f"tokenizer ids of {text!r}: {got_ids} vs {want_ids}")
        if problems:
            print(f"FAIL {label}: " + "; ".join(problems))
        else:
            print(f"OK {label}: logits, greedy {greedy} and {len(ref['texts'])} texts' ids equal")
    except Exception as e:
        print(f"FAIL {label}: {type(e).__name__}: {e}".replace("\n", " | "))
    sys.stdout.flush()
