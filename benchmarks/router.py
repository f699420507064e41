"""Three servers on one model behind a cache-aware router: does a conversation keep the server
that holds its cache, what does that save against round robin, and what does the shared page
store add (for round robin, and when a server dies)?

One run, on loopback, with a real router (``harness/router_proc.py``) and a real
``redis-server`` (``harness/redis_proc.py``) for the store. The workload: ``--conversations``
conversations of 4 turns, all sharing one system prompt (a town guide, ~600 tokens); turn 1 of
each brings a case file of its own (~900 tokens), turns 2-4 a question with a short note of its
own (~110 tokens), so its history is ~2,000 tokens by turn 4. Turn N of every conversation is
sent at once (one thread each), turn after turn; streamed, greedy, ``--max-tokens`` answer
tokens; TTFT is the time to the first content delta. Configurations, each on fresh servers,
caches and store:

  aware+store       the router's cache-aware policy; the servers share the store
  aware             the same, no store
  round_robin+store the router's round_robin policy; the servers share the store
  round_robin       round robin, no store
  aware+store+kill  as aware+store; after turn 2 the server holding the most conversations is
                    killed (SIGKILL, once its writes to the store are done); turns 3-4 go on

Per configuration: the share of prompt tokens read from a cache (usage's cached_tokens over
prompt_tokens; turns 1-4 and turns 2-4), median TTFT of turn 1 and of turns 2-4, failed
requests, and which server answered each turn (the one holding the answer's entry in memory).

``--router sglang``: SGLang's ``sglang-router`` (``cache_aware``, its ``--cache-threshold`` set
by ``--cache-threshold``: turn 1 shares less than that with what any server was sent, so new
conversations go where fewest requests run; later turns share more and keep their server).
``--router vllm``: vLLM's ``vllm-router`` with ``kv_aware``, fed by each server's KV events
(``--kv-events``, as maps). Round robin is the same router's ``round_robin`` policy (vllm-router
takes no KV event sources with it: its servers publish none).

The model: by default a random-weight llama from ``harness/tiny_model.py`` (6 layers, hidden
512) with the byte-level test tokenizer: the bundled default model needs ~17 s for one cold
2,000-token prompt on two cores, too slow for 5 x 24 x 4 requests. ``--model default`` (or any
``--model`` the server takes) uses that model instead. ``--quick``: the small tiny model, 6
conversations, short texts (a check that everything runs, well under two minutes).

The result goes to benchmarks/results/router/<run's UTC time>.json (vllm-router's runs under
vllm/ below it, and --quick runs under quick/ below that) unless --json names a file; ``--keep DIR`` keeps the servers' and router's
logs and caches.
Usage: .venv/bin/python -m benchmarks.router [--router sglang|vllm] [--quick]
       [--conversations 24] [--max-tokens 16] [--model tiny|default|...] [--only NAME ...]
       [--keep DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from mlx_kvserver.platform import blas

blas.maybe_reexec()

from benchmarks.record import OVERRIDE_HELP, write  # noqa: E402
from benchmarks.ttft import ask, document  # noqa: E402
from harness.redis_proc import RedisProc  # noqa: E402
from harness import router_proc  # noqa: E402
from harness.server_procs import HTTP, Server, free_port  # noqa: E402

TURNS = 4
# Between two turns, as a user's pause: a router fed by KV events learns of the last turn's
# pages as the answer is saved, a few milliseconds after its last token.
TURN_PAUSE_S = 0.5
# The tiny model of a full run: prefill heavy enough that a cached prefix shows in TTFT.
TINY_FULL = {"num_layers": 6, "hidden": 512, "heads": 8, "kv_heads": 4}
TINY_QUICK = {"num_layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2}


@dataclass(frozen=True)
class Sizes:
    """Target token counts: the shared system prompt, turn 1's case file, a later turn."""
    system: int = 600
    case: int = 900
    turn: int = 110


@dataclass(frozen=True)
class Config:
    name: str
    policy: str  # "aware" (the router's cache-aware policy) or "round_robin"
    store: bool
    kill_after: int | None = None  # the turn after which a server is killed


CONFIGS = (Config("aware+store", "aware", True), Config("aware", "aware", False),
           Config("round_robin+store", "round_robin", True),
           Config("round_robin", "round_robin", False),
           Config("aware+store+kill", "aware", True, kill_after=2))

# -- the workload: deterministic text ---------------------------------------------------------

NAMES = ["Ada", "Bruno", "Chen", "Dara", "Emil", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kofi",
         "Lena", "Mika", "Nora", "Omar", "Pia"]
THINGS = ["crates of apples", "bicycles", "fishing nets", "lanterns", "sacks of flour",
          "wooden chairs", "copper pipes", "rolls of cloth", "barrels of cider", "glass jars"]
PLACES = ["the harbour", "the old mill", "the library", "the railway yard", "the salt marsh",
          "the market square", "the northern forest", "the weather station", "the glass works"]
VERBS = ["reported", "counted", "delivered", "lost", "repaired", "sold", "found", "stored"]
ASKS = ["Which entries of the case mention {p}?", "Who {v} the most {t}, and when?",
        "How many {t} appear in the case in all?", "What happened at {p} on day {d}?",
        "Does anything in the case contradict the guide about {p}?",
        "List the people of the case who went to {p}."]


def sentence(rng: random.Random, i: int) -> str:
    return (f"Entry {i}: {rng.choice(NAMES)} {rng.choice(VERBS)} {rng.randint(2, 97)} "
            f"{rng.choice(THINGS)} near {rng.choice(PLACES)} on day {rng.randint(1, 365)}.")


def system_prompt(n: int) -> str:
    return ("You are the records assistant of a small town. Answer briefly from the town guide "
            "and the case file you are given.\n\n" + document(n))


def case_file(conv: int, n: int) -> str:
    rng = random.Random(1000 + conv)
    return (f"Case file {conv} ({rng.choice(PLACES)}):\n"
            + " ".join(sentence(rng, i + 1) for i in range(n)) + "\nRead it; I will ask next.")


def question(conv: int, turn: int, n: int) -> str:
    rng = random.Random(100_000 + 10 * conv + turn)
    ask_ = rng.choice(ASKS).format(p=rng.choice(PLACES), v=rng.choice(VERBS),
                                   t=rng.choice(THINGS), d=rng.randint(1, 365))
    words = " ".join(sentence(rng, 900 + i) for i in range(n // 8 + 1)).split()
    return f"Question {turn} about case {conv}: {ask_} A note first: {' '.join(words[:n])}"


def fit(make, target: int, count) -> int:
    """The ``n`` for which ``count(make(n))`` (tokens) comes closest to ``target``: two
    proportional steps from n = 8."""
    n = 8
    for _ in range(2):
        n = max(1, round(n * target / max(1, count(make(n)))))
    return n


@dataclass
class Workload:
    system: str
    cases: list[str]
    questions: list[list[str]]  # [conversation][turn 2..4]
    sizes: dict

    def user_turn(self, conv: int, turn: int) -> str:
        return self.cases[conv] if turn == 1 else self.questions[conv][turn - 2]


def build_workload(conversations: int, sizes: Sizes, count) -> Workload:
    """The texts of every conversation, sized in tokens with ``count`` (a server's tokenizer)."""
    n_sys = fit(system_prompt, sizes.system, count)
    n_case = fit(lambda n: case_file(0, n), sizes.case, count)
    n_turn = fit(lambda n: question(0, 2, n), sizes.turn, count)
    return Workload(
        system_prompt(n_sys), [case_file(c, n_case) for c in range(conversations)],
        [[question(c, t, n_turn) for t in range(2, TURNS + 1)] for c in range(conversations)],
        {"system_sentences": n_sys, "case_sentences": n_case, "turn_note_words": n_turn,
         "target_tokens": vars(sizes)})


# -- servers, store, router --------------------------------------------------------------------


class Cluster:
    """The servers on fresh caches (on a fresh store when ``store``) and the router over them;
    stopped by ``close``."""

    def __init__(self, args, config: Config, model: str, work: Path):
        self.work, self.redis, self.router, self.servers = work, None, None, []
        work.mkdir(parents=True)
        try:
            self._start(args, config, model, work)
        except BaseException:
            self.close()
            raise

    def _start(self, args, config: Config, model: str, work: Path) -> None:
        common = ["--page-size", str(args.page_size)]
        if config.store:
            self.redis = RedisProc(work / "redis").start()
            common += ["--kv-store", self.redis.url]
        fed = args.router == "vllm" and config.policy == "aware"  # kv_aware reads KV events
        events = [kv_events() if fed else [] for _ in range(args.servers)]
        self.servers = [Server(model, work / f"cache{i}", work / f"server{i}.log", *common,
                               *kv_events_flags(events[i]), warm=True)
                        for i in range(args.servers)]
        self.servers[0].start(timeout=300)  # the first starts the warm parent
        with ThreadPoolExecutor(len(self.servers)) as pool:
            list(pool.map(lambda s: s.start(timeout=300), self.servers[1:]))
        self.model = HTTP.get(f"{self.servers[0].url}/v1/models").json()["data"][0]["id"]
        self.router = make_router(args, config.policy, self.servers, events, work / "router.log")
        self.router.start()

    def alive(self) -> list[int]:
        return [i for i, s in enumerate(self.servers) if s.proc.poll() is None]

    def count_tokens(self, text: str) -> int:
        r = HTTP.post(f"{self.servers[0].url}/v1/messages/count_tokens",
                      json={"model": self.model, "max_tokens": 1,
                            "messages": [{"role": "user", "content": text}]})
        r.raise_for_status()
        return r.json()["input_tokens"]

    def holder(self, message_id: str | None) -> int | None:
        """The server holding the answer's entry in memory: the one that gave it (None when
        there is no id, or not exactly one server holds it)."""
        if not message_id:
            return None
        found = []
        for i in self.alive():
            r = HTTP.get(f"{self.servers[i].url}/v1/kv_cache/{message_id}")
            if r.status_code == 200 and r.json().get("in_memory"):
                found.append(i)
        return found[0] if len(found) == 1 else None

    def settle(self, i: int, deadline: float = 60) -> int:
        """Wait for server ``i``'s writes to the store; returns the writes still queued."""
        end, queued = time.monotonic() + deadline, -1
        while time.monotonic() < end:
            stats = HTTP.get(f"{self.servers[i].url}/v1/kv_cache/stats").json()["models"]
            queued = sum((m.get("store") or {}).get("queued", 0) for m in stats.values())
            if queued == 0:
                break
            time.sleep(0.05)
        return queued

    def close(self) -> None:
        if self.router is not None:
            self.router.stop()
        for s in self.servers:
            s.kill()
        if self.redis is not None:
            self.redis.stop()


def kv_events() -> list[str]:
    """A server's KV events endpoint and its replay endpoint, on ports of their own, bound by
    the server (``tcp://*``: the router connects to them; ``harness.router_proc.VllmRouter``
    gives it the loopback address)."""
    return [f"tcp://*:{free_port()}", f"tcp://*:{free_port()}"]


def kv_events_flags(endpoints: list[str]) -> list[str]:
    """The server's flags publishing its KV events on ``endpoints`` (none when empty), as maps:
    what vllm-router reads."""
    if not endpoints:
        return []
    return ["--kv-events", endpoints[0], "--kv-events-replay", endpoints[1],
            "--kv-events-format", "map"]


def policy_name(router: str, policy: str) -> str:
    if policy == "round_robin":
        return "round_robin"
    return "kv_aware" if router == "vllm" else "cache_aware"


def router_flags(args) -> list[str]:
    """The flags given to the router beyond its workers, policy and failover settings."""
    if args.router == "sglang":
        return ["--cache-threshold", str(args.cache_threshold)]
    return []


def make_router(args, policy: str, servers: list[Server], events: list[list[str]], log: Path):
    urls = [s.url for s in servers]
    name = policy_name(args.router, policy)
    if args.router == "sglang":
        return router_proc.Router(urls, log, *router_flags(args), policy=name)
    return router_proc.VllmRouter(urls, log, policy=name, kv_events=[e for e in events if e],
                                  block_size=args.page_size)


# -- one configuration --------------------------------------------------------------------------


def run_turn(cluster: Cluster, chats: list[list[dict]], turn: int, max_tokens: int) -> list[dict]:
    """Turn ``turn`` of every conversation at once (a thread each, released together); each
    answer is appended to its chat. Returns one record per conversation."""
    n = len(chats)
    start = threading.Barrier(n)
    out: list[dict] = [{} for _ in range(n)]

    def one(c: int) -> None:
        start.wait()
        t0 = time.perf_counter()
        try:
            res = ask(cluster.router.url + "/v1", chats[c], None, max_tokens,
                      model=cluster.model)
            out[c] = {"conv": c, "turn": turn, "ok": True, **{k: res[k] for k in (
                "ttft", "total", "prompt_tokens", "cached_tokens", "message_id", "text")}}
        except Exception as e:  # noqa: BLE001 -- any failure counts, with what it was
            out[c] = {"conv": c, "turn": turn, "ok": False, "error": f"{type(e).__name__}: {e}",
                      "total": time.perf_counter() - t0}

    threads = [threading.Thread(target=one, args=(c,)) for c in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c, rec in enumerate(out):
        rec["server"] = cluster.holder(rec.get("message_id"))
        chats[c].append({"role": "assistant", "content": rec.get("text", "")})
    return out


def run_config(args, config: Config, model: str, work: Path, workload: Workload | None,
               sizes: Sizes) -> tuple[dict, Workload]:
    t0 = time.perf_counter()
    cluster = Cluster(args, config, model, work)
    try:
        if workload is None:
            workload = build_workload(args.conversations, sizes, cluster.count_tokens)
        chats = [[{"role": "system", "content": workload.system}]
                 for _ in range(args.conversations)]
        records, killed = [], None
        for turn in range(1, TURNS + 1):
            if config.kill_after is not None and turn == config.kill_after + 1:
                killed = kill_busiest(cluster, [r for r in records if r["turn"] == turn - 1])
                killed["after_turn"] = turn - 1
            for c, chat in enumerate(chats):
                chat.append({"role": "user", "content": workload.user_turn(c, turn)})
            time.sleep(TURN_PAUSE_S)
            began = time.perf_counter()
            records += run_turn(cluster, chats, turn, args.max_tokens)
            print(f"  {config.name} turn {turn}: {time.perf_counter() - began:.1f} s", flush=True)
        workers = [{k: w.get(k) for k in ("url", "is_healthy")} for w in cluster.router.registered()]
    finally:
        cluster.close()
    result = {"config": vars(config), "router_policy": policy_name(args.router, config.policy),
              "summary": summarize(records, killed), "killed": killed,
              "router_workers_at_end": workers, "wall_s": round(time.perf_counter() - t0, 1),
              "requests": [{k: v for k, v in r.items() if k != "text"} for r in records]}
    return result, workload


def kill_busiest(cluster: Cluster, last_turn: list[dict]) -> dict:
    """Kill the server that answered the most conversations' last turn (server 0 when none is
    known), after its writes to the store are done."""
    homes = [r["server"] for r in last_turn if r.get("server") is not None]
    victim = max(set(homes), key=homes.count) if homes else 0
    queued = cluster.settle(victim)
    cluster.servers[victim].kill()
    return {"server": victim, "conversations": homes.count(victim),
            "store_writes_queued_at_kill": queued}


# -- figures ------------------------------------------------------------------------------------


def cached_share(records: list[dict]) -> float | None:
    ok = [r for r in records if r["ok"]]
    prompt = sum(r["prompt_tokens"] for r in ok)
    return round(sum(r["cached_tokens"] for r in ok) / prompt, 4) if prompt else None


def median_ttft(records: list[dict]) -> float | None:
    ttfts = [r["ttft"] for r in records if r["ok"]]
    return round(statistics.median(ttfts), 4) if ttfts else None


def summarize(records: list[dict], killed: dict | None = None) -> dict:
    """One configuration's figures from its requests (``conv``, ``turn``, ``ok``, ``ttft``,
    ``prompt_tokens``, ``cached_tokens``, ``server``)."""
    later = [r for r in records if r["turn"] >= 2]
    by_conv: dict[int, dict[int, int | None]] = {}
    for r in records:
        by_conv.setdefault(r["conv"], {})[r["turn"]] = r.get("server")
    known = moved = 0
    for turns in by_conv.values():
        for t, s in turns.items():
            if t >= 2 and s is not None and turns.get(t - 1) is not None:
                known += 1
                moved += s != turns[t - 1]
    per_turn = {}
    for t in sorted({r["turn"] for r in records}):
        servers = [r.get("server") for r in records if r["turn"] == t]
        per_turn[str(t)] = {str(s): servers.count(s) for s in sorted(
            set(servers), key=lambda s: (s is None, s))}
    out = {"requests": len(records), "failed": sum(not r["ok"] for r in records),
           "cached_share_turns_1_4": cached_share(records),
           "cached_share_turns_2_4": cached_share(later),
           "median_ttft_turn_1_s": median_ttft([r for r in records if r["turn"] == 1]),
           "median_ttft_turns_2_4_s": median_ttft(later),
           "turns_2_4_moved": moved, "turns_2_4_server_known": known,
           "answers_per_server_by_turn": per_turn}
    if killed is not None:
        after = [r for r in records if r["turn"] > killed["after_turn"]]
        out["median_ttft_after_kill_s"] = median_ttft(after)
        out["cached_share_after_kill"] = cached_share(after)
    return out


def overall(results: dict) -> dict:
    """The run's answers: the cache-aware policy's cached share, its TTFT against round robin
    without the store, and the kill run's failures and TTFT."""
    aware, rr, kill = (results[k]["summary"] for k in ("aware+store", "round_robin",
                                                        "aware+store+kill"))
    ratio = (round(aware["median_ttft_turns_2_4_s"] / rr["median_ttft_turns_2_4_s"], 3)
             if aware["median_ttft_turns_2_4_s"] and rr["median_ttft_turns_2_4_s"] else None)
    share = aware["cached_share_turns_2_4"]
    return {"aware_store_cached_share_turns_2_4": share,
            "aware_store_cached_share_turns_1_4": aware["cached_share_turns_1_4"],
            "ttft_turns_2_4_aware_store_over_round_robin": ratio,
            "kill_failed_requests": kill["failed"],
            "kill_median_ttft_turns_2_4_s": kill["median_ttft_turns_2_4_s"],
            "kill_median_ttft_after_kill_s": kill["median_ttft_after_kill_s"],
            "goals": {"cached_share_turns_2_4_at_least_0.9": share is not None and share >= 0.9,
                      "ttft_ratio_at_most_0.5": ratio is not None and ratio <= 0.5,
                      "kill_no_failed_request": kill["failed"] == 0}}


# -- the run -------------------------------------------------------------------------------------


def model_dir(args, work: Path) -> tuple[str, str]:
    """The ``--model`` the servers get, and the words the result's "model" field says."""
    if args.model != "tiny":
        return args.model, args.model
    from harness.tiny_model import make_tiny_model_dir

    shape = TINY_QUICK if args.quick else TINY_FULL
    path = make_tiny_model_dir(work / "model", seed=0, **shape)
    for name, key in (("config.json", "max_position_embeddings"),
                      ("tokenizer_config.json", "model_max_length")):
        cfg = json.loads((path / name).read_text())
        cfg[key] = 4096  # room for the ~2,000-token turns
        (path / name).write_text(json.dumps(cfg, indent=1))
    words = (f"tiny random-weight llama (harness/tiny_model.py, {shape}, float32, byte-level "
             "BPE of 320 tokens)" + ("" if args.quick else
                                     ": the bundled default model is too slow for this run on "
                                     "two CPU cores"))
    return str(path), words


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--router", choices=("sglang", "vllm"), default="sglang")
    ap.add_argument("--model", default="tiny", help="tiny (harness/tiny_model.py), or what "
                    "the server's --model takes (default: the bundled model)")
    ap.add_argument("--servers", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--page-size", type=int, default=32)
    ap.add_argument("--cache-threshold", type=float, default=0.5,
                    help="sglang-router's --cache-threshold (its default: 0.3)")
    ap.add_argument("--only", nargs="*", choices=[c.name for c in CONFIGS],
                    help="run these configurations only")
    ap.add_argument("--quick", action="store_true",
                    help="the small tiny model, 6 conversations, short texts")
    ap.add_argument("--keep", type=Path, metavar="DIR",
                    help="keep the servers' and router's logs and caches in DIR (new)")
    ap.add_argument("--json", type=Path, help=OVERRIDE_HELP)
    args = ap.parse_args()
    sizes = Sizes()
    if args.quick:
        args.conversations, args.max_tokens, sizes = 6, 8, Sizes(150, 220, 60)
    try:
        (router_proc.router_binary if args.router == "sglang" else
         router_proc.vllm_router_binary)()
    except BaseException as e:  # the harness skips a test; a benchmark stops, saying why
        if isinstance(e, KeyboardInterrupt):
            raise
        raise SystemExit(f"no {args.router} router: {e}") from None
    configs = [c for c in CONFIGS if not args.only or c.name in args.only]
    t0 = time.perf_counter()
    results, workload = {}, None
    with contextlib.ExitStack() as stack:
        work = args.keep or Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="bench-router-")))
        work.mkdir(parents=True, exist_ok=True)
        model, words = model_dir(args, work)
        for i, config in enumerate(configs):
            print(f"{config.name}:", flush=True)
            results[config.name], workload = run_config(args, config, model, work / f"run{i}",
                                                        workload, sizes)
            print(json.dumps(results[config.name]["summary"]), flush=True)
    out = {"model": words, "router": args.router, "router_flags": router_flags(args),
           "router_failover_flags": list(router_proc.FAILOVER),
           "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "workload": workload.sizes if workload else None,
           "summary": overall(results) if len(results) == len(CONFIGS) else None,
           "configs": results, "wall_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(out["summary"], indent=1))
    series = "router" + ("/vllm" if args.router == "vllm" else "")  # each router its own series
    write(series + ("/quick" if args.quick else ""), json.dumps(out, indent=1),
          override=args.json)


if __name__ == "__main__":
    main()
