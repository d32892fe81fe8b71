import atexit, gc, json, os, sys, time
if "serve" in sys.argv:
    T0 = time.perf_counter()
    stats = {g: [0, 0.0, 0.0] for g in range(3)}
    full = []
    start = {}
    def cb(phase, info):
        if phase == "start":
            start["t"] = time.perf_counter()
        else:
            now = time.perf_counter(); d = (now - start["t"]) * 1e3
            g = info["generation"]; s = stats[g]
            s[0] += 1; s[1] += d; s[2] = max(s[2], d)
            if g == 2: full.append((round(now - T0, 2), round(d, 1), gc.get_freeze_count()))
    gc.callbacks.append(cb)
    def dump():
        with open(os.path.join(os.environ["GCPROBE_OUT"], f"gc-{os.getpid()}.json"), "w") as f:
            json.dump({"objects": len(gc.get_objects()), "frozen": gc.get_freeze_count(), "stats": stats, "full": full}, f)
    atexit.register(dump)
