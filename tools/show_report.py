"""Print the text outputs of an executed notebook (for a quick read in a terminal)."""

import json
import sys

for path in sys.argv[1:]:
    nb = json.load(open(path))
    for c in nb["cells"]:
        if c["cell_type"] != "code":
            continue
        for o in c.get("outputs", []):
            if o.get("output_type") == "stream":
                text = "".join(o["text"])
                if "it/s" not in text and "s/it" not in text:
                    print("STREAM", text[:400])
            elif "data" in o:
                d = o["data"]
                if "text/markdown" in d:
                    print("".join(d["text/markdown"])[:3000])
                elif "image/png" in d:
                    print("[image]")
                else:
                    print("".join(d.get("text/plain", ""))[:400])
            elif o.get("output_type") == "error":
                print("ERROR", o["ename"], o["evalue"])
