"""benchmarks/coinstac_run.py: a whole run as a COINSTAC computation."""

from sections import table

TEMPLATE = """\
### A whole run as a COINSTAC computation

Real coinstac websocket services on 127.0.0.1 driven by dpneuro.deploy.coinstac_sim (4 sites x 3 subjects x 60
volumes, 30 x 30 grid, 100 parcels, k = 4) against the in-process simulation of the same reduce + unmix stages.
Script's note: {note}.

{run}

{table}

{fig}
"""


def fields(R):
    rows = R.csv("coinstac_run.csv")
    if not rows:
        return None
    return {"note": R.json("coinstac_run.json").get("meta", {}).get("note", ""),
            "run": R.run("python benchmarks/coinstac_run.py --rounds " + " ".join(str(r["ica_rounds"]) for r in rows),
                         ["coinstac_run.csv", "coinstac_run.json", "coinstac_run.png"], R.runtime("coinstac_run")),
            "table": table(["ICA rounds", "iterations", "message files", "COINSTAC s", "ms per iteration",
                            "in-process s", "same W"],
                           [[r["ica_rounds"], r["iterations"], r["message_files"], r["coinstac_seconds"],
                             r["ms_per_iteration"], r["inprocess_seconds"], r["same_W_as_inprocess"]] for r in rows]),
            "fig": R.fig("coinstac_run.png", "COINSTAC run")}
