import atexit, gc, json, os, sys, time
if "serve" in sys.argv:
    T0 = time.perf_counter()
    passes = []
    start = {}
    def cb(phase, info):
        if phase == "start":
            start["t"] = time.perf_counter()
        else:
            now = time.perf_counter()
            passes.append((round(now - T0, 4), info["generation"], round((now - start["t"]) * 1e3, 3), info["collected"]))
    gc.callbacks.append(cb)
    def dump():
        with open(os.path.join(os.environ["GCPROBE_OUT"], f"gc-{os.getpid()}.json"), "w") as f:
            json.dump({"frozen": gc.get_freeze_count(), "passes": passes, "threshold": gc.get_threshold()}, f)
    atexit.register(dump)
