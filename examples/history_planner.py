"""stable-worldmodel's HistoryBuffer, shared: env workers append their envs, a planner reads.

Two workers own two envs each and append just their rows
(``append(info, env_ids=[...])``); the planner gets strided history for
every env, or for the envs it re-plans, at macro-action cadence.

    HistoryBuffer(n_envs=4, max_len=8, action_block=2, block_keys=("action",))
    get(3) -> pixels (4, 3, 16, 16, 3) uint8 (frames at ages 4, 2, 0),
              action (4, 2, 4) f32 (the 2 blocks of 2 actions between them), task (4, 3) <U7

    python examples/history_planner.py [--steps 6]
"""
import argparse
import multiprocessing as mp

import numpy as np

import shmbuf

SPEC = {"pixels": ((1, 16, 16, 3), np.uint8), "action": ((1, 2), np.float32),
        "task": ((), "U16")}   # declared, so workers may append first


def env_worker(buf, env_ids, steps):
    """Appends ``steps`` entries for its envs: frames and actions hold the step number."""
    n = len(env_ids)
    for t in range(steps):
        buf.append({"pixels": np.full((n, 1, 16, 16, 3), t, np.uint8),
                    "action": np.full((n, 1, 2), t, np.float32), "task": "reach-2"},
                   env_ids=env_ids)
    buf.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()

    with shmbuf.HistoryBuffer(n_envs=4, max_len=8, action_block=2, block_keys=("action",),
                              spec=SPEC) as buf:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=env_worker, args=(buf, ids, args.steps), daemon=True)
                 for ids in ([0, 1], [2, 3])]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        out = buf.get(3)
        print("get(3): " + ", ".join(f"{k} {tuple(v.shape)} {v.dtype}"
                                     for k, v in sorted(out.items())))
        frames = out["pixels"][0, :, 0, 0, 0].tolist()   # env 0's strided frames
        print(f"env 0 frames at steps {frames}, blocks {out['action'][0, :, ::2].tolist()}")
        buf.reset(env_ids=[0])   # env 0 starts a new episode
        replan = buf.get(3, env_ids=[1, 3])
        print(f"done: {len(buf)} min entries, num_strided {buf.num_strided()}, "
              f"re-planned {len(replan['pixels'])} envs, "
              f"exit codes {[p.exitcode for p in procs]}")


if __name__ == "__main__":
    main()
