import tempfile, time, threading, os
from pathlib import Path
import autotune as a
with tempfile.TemporaryDirectory() as tmp:
    root=a.linked(Path(tmp))
    for ov in (("data.num_workers=2","data.prefetch_factor=2","data.autotune=false"),):
        t0=time.perf_counter(); c0=time.process_time()
        x=a.epochs_images_per_s(root,*ov)
        w=time.perf_counter()-t0; c=time.process_time()-c0
        print(ov, [round(v) for v in x], "wall", round(w,1), "main cpu", round(c,1), "cores", round(c/w,2))
        print("threads", threading.active_count(), os.environ.get("OMP_WAIT_POLICY"))
