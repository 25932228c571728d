"""Evaluation prototype: torchft hot recovery over dp on CPU / gloo (issue 27, item 4). Not part of shardlib.

Runs with a throwaway venv that has torchft (shardlib's venv does not; see docs/torchft.md). torchft-nightly
2026.10.26 passes; torchft 0.2.0 (the release) reproduces its DDP bug (the surviving replica dies, exit status 1):

    python3 -m venv /tmp/ftvenv2 && /tmp/ftvenv2/bin/pip install torch==2.13.0 numpy
    /tmp/ftvenv2/bin/pip install torchft-nightly==2026.10.26        # (or torchft==0.2.0)
    OMP_NUM_THREADS=1 /tmp/ftvenv2/bin/python benchmarks/torchft_eval.py --procs 2 --heartbeat-timeout-ms 1000

(numpy: torchft's PGTransport needs it and neither wheel declares it.) About 2 minutes on 2 cores.

What it does. A parent process starts torchft's lighthouse (in process, on 127.0.0.1) and ``--groups`` replica
groups of ``--procs`` worker processes each. A replica group stands for one shardlib tp x pp group: its ranks hold a
two-layer MLP sharded Megatron-style (column-parallel then row-parallel, one sum over an intra-group gloo group),
so each group rank holds different parameters; torchft's DistributedDataParallel averages each rank's shard over the
dp replicas through torchft's reconfigurable ProcessGroupGloo (one per group rank, as in HSDP). Each step:
``optimizer.zero_grad()`` (torchft: start the quorum), forward/backward, ``optimizer.step()`` (torchft: commit only
if every collective of the step succeeded in every rank of the group).

Run 1 (reference): no failure. Run 2: at committed step ``--kill-at`` the parent SIGKILLs one rank of the last replica
group (which sleeps ``--victim-lag`` s before each backward, so its peers are waiting inside the gradient all-reduce
when it dies), then kills its siblings (what torchelastic's agent does: a group restarts whole), waits ``--down`` seconds
and restarts the group with a fresh rendezvous store; the restarted ranks join the next quorum and heal from a live
peer (torchft's PGTransport: the state dict is sent over the torchft gloo group). Each run is done twice: the same
batches on every replica (averaging identical gradients is exact, so the trajectory must not depend on who is
present and the final weights must equal the reference bit for bit) and distinct batches per replica (a step taken
while a replica is down averages fewer gradients, so only "the replicas agree with each other" is promised).

Every server listens on 127.0.0.1 only: the lighthouse (``bind``), each group's TCPStore (a socket bound to
loopback, handed to TCPStore as ``master_listen_fd``, as shardlib.train.launch does), torchft's ManagerServer (its
``bind`` is hard-coded to ``[::]:port`` in torchft 0.2.0 and the nightly; the worker wraps the constructor to pass 127.0.0.1:0) and
gloo (GLOO_SOCKET_IFNAME=lo; torchft builds its gloo groups itself, on the address the host name resolves to, here
127.0.0.1). torchft-nightly's process groups host a rendezvous TCPStore of their own, created on every interface; the
worker hands them one on loopback (a private attribute, ``_rendezvous_store``). torchft's default HTTP checkpoint
transport binds every interface, so it is not used.

Output: a JSON summary on stdout (and ``--json``): per-step timings of the surviving replica during the failure,
recovery time of the restarted one, and the final-weight comparisons. Exit status 1 when a surviving rank did not
finish, the replicas' final weights differ, or (same batches) they differ from the reference's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

LOOPBACK = "127.0.0.1"


# ----------------------------------------------------------------------------------------------------------- worker

def worker(a) -> None:
    t_proc = time.time()
    import torch
    import torch.distributed as dist
    t0 = time.time()
    import torchft
    import torchft.manager
    from torchft.checkpointing.pg_transport import PGTransport
    t_import = time.time() - t0

    import logging
    logging.basicConfig(level=logging.INFO, format="%(asctime)s.%(msecs)03d %(name)s %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(1)
    group, rank, procs = a.group, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    log = open(a.log, "a", buffering=1)

    def emit(**kw):
        log.write(json.dumps({"g": group, "r": rank, "inc": a.incarnation, "t": time.time(), **kw}) + "\n")

    # torchft (0.2.0 and nightly 2026.10.26) binds its ManagerServer to [::]:port; keep it on loopback.
    real_server = torchft.manager.ManagerServer

    def loopback_server(**kw):
        kw["bind"] = f"{LOOPBACK}:0"
        return real_server(**kw)

    torchft.manager.ManagerServer = loopback_server

    store = dist.TCPStore(LOOPBACK, int(os.environ["MASTER_PORT"]), is_master=False, wait_for_workers=False)
    intra = None
    if procs > 1:  # the replica group's own (tp) group: plain gloo, not fault tolerant
        dist.init_process_group("gloo", store=dist.PrefixStore("intra", store), rank=rank, world_size=procs)
        intra = dist.group.WORLD

    torch.manual_seed(0)  # identical initial weights on every replica (init_sync still heals a late joiner)
    d, hidden = a.dim, a.hidden
    w1 = torch.randn(hidden, d) / d ** 0.5
    w2 = torch.randn(1, hidden) / hidden ** 0.5
    shard = hidden // procs

    class Shard(torch.nn.Module):  # column-parallel fc1, row-parallel fc2
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Parameter(w1[rank * shard:(rank + 1) * shard].clone())
            self.fc2 = torch.nn.Parameter(w2[:, rank * shard:(rank + 1) * shard].clone())

        def forward(self, x):
            y = torch.relu(x @ self.fc1.t()) @ self.fc2.t()
            return _SumForward.apply(y) if intra is not None else y

    class _SumForward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y):
            y = y.clone()
            dist.all_reduce(y, group=intra)
            return y

        @staticmethod
        def backward(ctx, g):
            return g

    model = Shard()
    inner_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def state_dict():
        return {"model": model.state_dict(), "optim": inner_opt.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        inner_opt.load_state_dict(sd["optim"])

    pg = torchft.ProcessGroupGloo(timeout=timedelta(seconds=a.pg_timeout))
    if getattr(pg, "_rendezvous_store", False) is None:
        # torchft-nightly: each process group hosts its own rendezvous TCPStore, created on first use with
        # is_master=True on port 0, which binds every interface; hand it one listening on loopback instead.
        pg._rendezvous_store = loopback_store()[0]
    t0 = time.time()
    manager = torchft.Manager(
        pg=pg, min_replica_size=1, load_state_dict=load_state_dict, state_dict=state_dict,
        replica_id=f"replica_{group}", hostname=LOOPBACK, timeout=timedelta(seconds=a.timeout),
        quorum_timeout=timedelta(seconds=a.timeout), connect_timeout=timedelta(seconds=a.timeout),
        checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=a.timeout), device=torch.device("cpu")),
        rank=rank, world_size=procs, store_addr=LOOPBACK, store_port=int(os.environ["MASTER_PORT"]),
        lighthouse_addr=a.lighthouse, use_async_quorum=not a.sync_quorum)
    t_manager = time.time() - t0
    ddp = torchft.DistributedDataParallel(manager, model)
    opt = torchft.Optimizer(manager, inner_opt)
    emit(ev="ready", import_s=t_import, manager_s=t_manager, proc_s=time.time() - t_proc)
    if a.go:
        while not Path(a.go).exists():
            time.sleep(0.01)

    healed_logged = False
    while manager.current_step() < a.steps:
        t_step = time.time()
        opt.zero_grad()                      # starts the quorum (async)
        step = manager.current_step()        # a healing replica's step changes once healed; its grads are zeroed
        gen = torch.Generator().manual_seed(1000 * step + (0 if a.same_data else group))
        x = torch.randn(a.batch, d, generator=gen)
        y = x[:, :1].sin()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        if a.lag:  # the victim group arrives late at the gradient all-reduce, so its peers wait inside it when it dies
            time.sleep(a.lag)
        loss.backward()
        time.sleep(a.step_sleep)              # stands for the rest of a real step's compute
        opt.step()                           # steps the inner optimizer only if should_commit()
        emit(ev="step", step=manager.current_step(), before=step, committed=manager.current_step() == step + 1,
             dt=time.time() - t_step, participants=manager.num_participants(), quorum=manager._quorum_id,
             loss=loss.item())
        if not healed_logged and a.incarnation > 0 and manager.current_step() == step + 1:
            emit(ev="healed", step=manager.current_step(), since_start=time.time() - t_proc)
            healed_logged = True
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
               Path(a.outdir) / f"final_g{group}_r{rank}.pt")
    emit(ev="done", step=manager.current_step())
    if intra is not None:
        dist.barrier(group=intra)
    manager.shutdown(wait=False)
    log.close()
    os._exit(0)


# ----------------------------------------------------------------------------------------------------------- parent

def loopback_store():
    from torch.distributed import TCPStore
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((LOOPBACK, 0))
    sock.listen()
    port = sock.getsockname()[1]
    store = TCPStore(LOOPBACK, port, 1, True, timedelta(seconds=60), wait_for_workers=False, multi_tenant=True,
                     master_listen_fd=sock.fileno())
    sock.detach()
    return store, port


def read_log(path):
    out = []
    if Path(path).exists():
        for line in Path(path).read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def run(a, kill: bool, same_data: bool, workdir: Path) -> dict:
    from torchft._torchft import LighthouseServer
    workdir.mkdir(parents=True, exist_ok=True)
    logf, go = workdir / "log.jsonl", workdir / "go"
    t0 = time.time()
    lighthouse = LighthouseServer(bind=f"{LOOPBACK}:0", min_replicas=1, join_timeout_ms=a.join_timeout_ms,
                                  quorum_tick_ms=a.quorum_tick_ms, heartbeat_timeout_ms=a.heartbeat_timeout_ms)
    lighthouse_s = time.time() - t0
    lighthouse_addr = f"http://{LOOPBACK}:{lighthouse.address().rsplit(':', 1)[1]}"  # address() names the host
    stores, procs = {}, {}
    victim = a.groups - 1

    def start_group(g, inc, wait_go):
        stores[g] = loopback_store()  # a fresh rendezvous per incarnation, as a restarted torchelastic agent has
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", MASTER_ADDR=LOOPBACK,
                   MASTER_PORT=str(stores[g][1]), WORLD_SIZE=str(a.procs), PYTHONWARNINGS="ignore")
        procs[g] = []
        for r in range(a.procs):
            cmd = [sys.executable, __file__, "--worker", "--group", str(g), "--incarnation", str(inc),
                   "--log", str(logf), "--outdir", str(workdir), "--lighthouse", lighthouse_addr]
            cmd += ["--go", str(go)] if wait_go else []
            cmd += ["--same-data"] if same_data else []
            cmd += ["--sync-quorum"] if a.sync_quorum else []
            cmd += ["--lag", str(a.victim_lag)] if kill and g == victim and inc == 0 else []
            for k in ("steps", "step_sleep", "dim", "hidden", "batch", "timeout", "pg_timeout"):
                cmd += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
            procs[g].append(subprocess.Popen(cmd, env=dict(env, RANK=str(r)), stdout=open(workdir / f"out_g{g}_r{r}_i{inc}.txt", "w"),
                                             stderr=subprocess.STDOUT))

    for g in range(a.groups):
        start_group(g, 0, True)
    while sum(e["ev"] == "ready" for e in read_log(logf)) < a.groups * a.procs:
        time.sleep(0.05)
    go.touch()
    t_go = time.time()
    killed_at, restarted_at = None, None
    deadline = time.time() + a.run_timeout
    while time.time() < deadline:
        if all(p.poll() is not None for ps in procs.values() for p in ps):
            break
        if kill and killed_at is None:
            ev = read_log(logf)
            if any(e["ev"] == "step" and e["g"] == victim and e["committed"] and e["step"] >= a.kill_at for e in ev):
                ps = procs[victim]
                ps[-1].send_signal(signal.SIGKILL)  # one rank dies ...
                killed_at = time.time()
                time.sleep(0.2)
                for p in ps:  # ... and the agent takes its group down
                    p.send_signal(signal.SIGKILL)
                for p in ps:
                    p.wait()
        if kill and killed_at is not None and restarted_at is None and time.time() - killed_at >= a.down:
            restarted_at = time.time()
            start_group(victim, 1, False)
        time.sleep(0.02)
    else:
        for ps in procs.values():
            for p in ps:
                p.kill()
    rcs = {g: [p.wait() for p in ps] for g, ps in procs.items()}
    lighthouse.shutdown()
    ev = read_log(logf)
    res = {"kill": kill, "same_data": same_data, "lighthouse_start_s": lighthouse_s, "rcs": rcs,
           "wall_s": time.time() - t_go,
           "import_torchft_s": [e["import_s"] for e in ev if e["ev"] == "ready"],
           "manager_init_s": [e["manager_s"] for e in ev if e["ev"] == "ready"],
           "finished": [(e["g"], e["r"]) for e in ev if e["ev"] == "done"]}
    steps = [e for e in ev if e["ev"] == "step"]
    normal = [e["dt"] for e in steps if e["g"] == 0 and e["r"] == 0 and (killed_at is None or e["t"] < killed_at)]
    res["step_s_median_healthy"] = sorted(normal)[len(normal) // 2] if normal else None
    if killed_at is not None:
        surv = [e for e in steps if e["g"] == 0 and e["r"] == 0 and e["t"] >= killed_at]
        healed = [e for e in ev if e["ev"] == "healed"]
        alone = [e for e in surv if e["participants"] < a.groups]
        back = next((e for e in surv if alone and e["t"] > alone[0]["t"] and e["participants"] == a.groups), None)
        first_commit = next((e for e in surv if e["committed"]), None)
        res["survivor"] = {
            "discarded_steps": [(e["before"], round(e["t"] - killed_at, 3)) for e in surv if not e["committed"]],
            "kill_to_first_commit_s": round(first_commit["t"] - killed_at, 3) if first_commit else None,
            "longest_step_s": round(max(e["dt"] for e in surv), 3) if surv else None,
            "steps_committed_alone": sum(e["committed"] for e in alone),
            "step_s_median_alone": round(sorted(e["dt"] for e in alone)[len(alone) // 2], 4) if alone else None,
            "rejoin_step_s": round(back["dt"], 3) if back else None,
            "rejoin_at_step": back["before"] if back else None,
            "participants_after_rejoin": back["participants"] if back else None,
        }
        res["victim"] = {
            "killed_after_step": max(e["step"] for e in steps if e["g"] == victim and e["inc"] == 0),
            "down_s": a.down,
            "restart_to_ready_s": [round(e["t"] - restarted_at, 3) for e in ev if e["ev"] == "ready" and e["inc"] == 1],
            "restart_to_first_committed_step_s": [round(e["t"] - restarted_at, 3) for e in healed],
            "healed_at_step": [e["step"] for e in healed],
            "kill_to_healed_s": [round(e["t"] - killed_at, 3) for e in healed],
        }
    return res


def compare(a, dirs) -> dict:
    import torch
    out = {}

    def load(d, g, r):
        p = Path(d) / f"final_g{g}_r{r}.pt"
        return torch.load(p) if p.exists() else None

    for name, d in dirs.items():
        if not name.startswith("kill"):
            continue
        ref = dirs[name.replace("kill", "ref")]
        agree, vs_ref = True, True
        maxdiff = 0.0
        for r in range(a.procs):
            base = load(ref, 0, r)
            for g in range(a.groups):
                sd = load(d, g, r)
                if sd is None or base is None:
                    agree = vs_ref = None
                    continue
                same_group0 = load(d, 0, r)
                agree = agree and all(torch.equal(sd[k], same_group0[k]) for k in sd)
                vs_ref = vs_ref and all(torch.equal(sd[k], base[k]) for k in sd)
                maxdiff = max([maxdiff] + [(sd[k] - base[k]).abs().max().item() for k in sd])
        out[name] = {"replicas_bitwise_equal": agree, "bitwise_equal_to_reference": vs_ref,
                     "max_abs_diff_to_reference": maxdiff}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true")
    p.add_argument("--group", type=int, default=0)
    p.add_argument("--incarnation", type=int, default=0)
    p.add_argument("--log"), p.add_argument("--outdir"), p.add_argument("--lighthouse"), p.add_argument("--go")
    p.add_argument("--same-data", action="store_true")
    p.add_argument("--sync-quorum", action="store_true", help="Manager(use_async_quorum=False)")
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--procs", type=int, default=1, help="ranks per replica group (a tp group)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--kill-at", type=int, default=30)
    p.add_argument("--down", type=float, default=2.0, help="seconds the failed group stays down")
    p.add_argument("--step-sleep", type=float, default=0.05, help="seconds of simulated compute per step")
    p.add_argument("--victim-lag", type=float, default=0.2,
                   help="seconds the victim group sleeps before backward: the kill lands while its peers wait in the "
                        "gradient all-reduce (0: wherever it lands)")
    p.add_argument("--lag", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--timeout", type=float, default=20.0, help="Manager timeouts (s)")
    p.add_argument("--pg-timeout", type=float, default=5.0, help="torchft ProcessGroupGloo timeout (s)")
    p.add_argument("--join-timeout-ms", type=int, default=10000)
    p.add_argument("--quorum-tick-ms", type=int, default=100)
    p.add_argument("--heartbeat-timeout-ms", type=int, default=5000)
    p.add_argument("--run-timeout", type=float, default=240.0)
    p.add_argument("--modes", default="same,distinct", help="comma list of same,distinct")
    p.add_argument("--json")
    a = p.parse_args()
    if a.worker:
        return worker(a)
    root = Path(tempfile.mkdtemp(prefix="torchft_eval_"))
    results, dirs = {"args": vars(a), "workdir": str(root)}, {}
    import torch
    from importlib import metadata
    dists = {}
    for dist_name in ("torchft", "torchft-nightly"):
        try:
            dists[dist_name] = metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            pass
    results["versions"] = {"torch": torch.__version__, **dists, "python": sys.version.split()[0]}
    for mode in a.modes.split(","):
        for kill in (False, True):
            name = f"{'kill' if kill else 'ref'}_{mode}"
            dirs[name] = root / name
            results[name] = run(a, kill, mode == "same", dirs[name])
            print(json.dumps({name: results[name]}), file=sys.stderr, flush=True)
    results["compare"] = compare(a, dirs)
    text = json.dumps(results, indent=1)
    print(text)
    if a.json:
        Path(a.json).write_text(text)
    failed = [name for name, c in results["compare"].items()
              if c["replicas_bitwise_equal"] is not True
              or (name.endswith("same") and c["bitwise_equal_to_reference"] is not True)
              or any(rc != 0 for rcs in results[name]["rcs"].values() for rc in rcs)]
    if failed:
        print(f"FAILED: {failed}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
