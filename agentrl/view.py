"""`agentrl view RUN_DIR [--port N]`: a local web page over a run, finished or still running.

Pages (server-rendered with Jinja2 on aiohttp):
- /                 the phases, the held-out score over minutes and the sampled reward over RL steps,
                    the evaluations and the RL steps
- /eval/NAME        one evaluation's episodes, filtered by score, a task field or a failure label
- /episode/eval/NAME/I, /episode/rl/LINE/I
                    one episode: the conversation with the policy's tokens marked (each with its
                    log-prob, the policy version that sampled it and, for a trained RL episode, its
                    advantage), the reward terms, the tool calls and their results
- /question?task_id=ID
                    one held-out question side by side across the evaluations (before, after SFT, ...)
- /step/N           the groups the learner trained at step N

It reads the run directory only (agentrl/common/records.py says what a run keeps), so a run copied
from another host opens the same; a file still being written is read up to its last whole line. A
folder that is not a run gets exit 2 naming what is missing. It binds loopback unless --host says
otherwise; on another address every request needs the view's token (the rule of the server's
control endpoints, agentrl/common/control_auth.py): given once as `?token=`, then kept in a cookie.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import math
import os
import secrets
import signal
import sys
import tomllib
from pathlib import Path

from aiohttp import web

from agentrl.common.control_auth import is_loopback
from agentrl.common.records import EPISODES_FILE, read_json_lines

TOKEN_ENV = "AGENTRL_VIEW_TOKEN"
COOKIE = "agentrl_view_token"
TEMPLATES = Path(__file__).resolve().parent / "templates" / "view"


class NotARun(Exception):
    """The folder is not a run directory; the message names what is missing."""


# --- reading the run -------------------------------------------------------------------------------


class Run:
    """What the pages show, read from the run directory at each request (a running run grows)."""

    def __init__(self, path: Path):
        self.path = path
        if not path.is_dir():
            raise NotARun(f"{path}: no such folder")
        if not (path / "config.toml").is_file():
            raise NotARun(f"{path} is not a run directory: it has no config.toml (agentrl train writes it first)")

    def _jsonl(self, rel: str) -> list[dict]:
        path = self.path / rel
        return read_json_lines(path)[0] if path.is_file() else []

    def phases(self) -> dict:
        path = self.path / "phases.json"
        if not path.is_file():
            return {}
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError:  # being rewritten: shown on the next request
            return {}

    def evaluations(self) -> list[dict]:
        """evals.jsonl's summaries, each with `name` (its files' stem) when its episodes were kept."""
        out = []
        for summary in self._jsonl("evals.jsonl"):
            name = f"{summary.get('label')}-v{summary.get('served_version')}"
            kept = (self.path / "evals" / f"{name}.text.jsonl.gz").is_file()
            out.append({**summary, "name": name if kept else None})
        return out

    def steps(self) -> list[dict]:
        """The learner's metrics lines, the last of each step (a step redone after a restart wins)."""
        last: dict[int, dict] = {}
        for record in self._jsonl("rl/metrics.jsonl"):
            if "step" in record:
                last[int(record["step"])] = record
        return [last[k] for k in sorted(last)]

    def eval_episodes(self, name: str) -> list[dict]:
        if "/" in name or name.startswith("."):
            raise web.HTTPNotFound(text=f"no evaluation {name!r}")
        path = self.path / "evals" / f"{name}.text.jsonl.gz"
        if not path.is_file():
            raise web.HTTPNotFound(text=f"no stored episodes for evaluation {name!r}")
        episodes = [normalized(e) for e in read_json_lines(path)[0]]
        per_task = {r["task_id"]: r for r in self._jsonl(f"evals/{name}.jsonl") if "task_id" in r}
        for e in episodes:
            row = per_task.get(e["task_id"], {})
            if not e["metrics"]:  # a record of an older agentrl: the per-task file has the metrics
                e["metrics"] = {k: v for k, v in row.items() if isinstance(v, int | float) and not isinstance(v, bool)}
            e["fields"] = row.get("group") or {k: str(v) for k, v in ((e["task"] or {}).get("metadata") or {}).items()
                                               if isinstance(v, str | int | float | bool)}
        return episodes

    def groups(self) -> list[dict]:
        groups = self._jsonl(f"actor/{EPISODES_FILE}")
        for g in groups:
            g["episodes"] = [normalized(e) for e in g.get("episodes", [])]
        return groups

    def learner_config(self) -> dict:
        path = self.path / "learner-rl.toml"
        return tomllib.loads(path.read_text()) if path.is_file() else {}


def normalized(episode: dict) -> dict:
    """An episode record with every field the pages read (a record of an older agentrl has fewer)."""
    defaults = {"task_id": "", "status": "", "error": None, "task_reward": 0.0, "metrics": {}, "task": None, "turns": [],
                "calls": [], "answer": None, "segments": None, "text": ""}
    return {**defaults, **{k: v for k, v in episode.items() if v is not None or k not in defaults}}


def score_metric(run: Run) -> str:
    return next((e["score_metric"] for e in run.evaluations() if "score_metric" in e), "score")


def failure_labels(episode: dict) -> list[str]:
    return sorted(k for k, v in (episode.get("metrics") or {}).items() if k.startswith("fail_") and v)


def advantages(run: Run, group: dict, step: int | None) -> list[list[float]] | None:
    """Per episode of `group`, the advantage of each action token, as the learner computed it at
    `step` for this group alone (exact for the group estimators: grpo, dr_grpo, rloo), or None
    when the group was not trained."""
    if step is None:
        return None
    from agentrl.common.records import trajectory_of
    from agentrl.common.trajectory import TrajectoryGroup
    from agentrl.learner.advantages import AdvantageConfig, compute_advantages, filter_groups
    from agentrl.learner.rewards import RewardSchedule

    config = run.learner_config()
    trainer = config.get("trainer", {})
    adv_config = AdvantageConfig(**trainer.get("advantage", {}))
    if adv_config.estimator not in ("grpo", "dr_grpo", "rloo"):  # the others whiten over the whole batch
        return None
    weights = RewardSchedule(**config.get("reward_schedule", {})).weights(step)
    trajs = [trajectory_of(e) for e in group["episodes"]]
    kept = filter_groups([TrajectoryGroup(group["group_id"], group["task_id"], trajs)], weights, adv_config).groups
    if not kept:
        return None
    by_index = {t.sample_index: a for t, a in zip(kept[0].trajectories, compute_advantages(kept, weights, adv_config)[0],
                                                   strict=True)}
    out = []
    for traj in trajs:
        adv = by_index.get(traj.sample_index)
        out.append([float(adv[i]) for i in range(len(adv)) if traj.is_action[i]] if adv is not None else [])
    return out


def steps_of_groups(run: Run) -> dict[str, int]:
    return {gid: int(record["step"]) for record in run.steps() for gid in record.get("group_ids", [])}


def token_spans(segment: dict, advantages_: list[float] | None) -> list[dict]:
    """An action segment's tokens: text, log-prob, probability, version and advantage."""
    out = []
    for i, piece in enumerate(segment.get("pieces", [])):
        logprob = segment["logprobs"][i]
        out.append({"text": piece, "logprob": logprob, "p": math.exp(logprob), "version": segment["versions"][i],
                    "adv": advantages_[i] if advantages_ is not None and i < len(advantages_) else None})
    return out


# --- the app -------------------------------------------------------------------------------------------


def make_app(run_dir: Path, token: str | None = None) -> web.Application:
    import jinja2

    run = Run(run_dir)
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True,
                             undefined=jinja2.ChainableUndefined)  # a field an older or running run lacks shows empty
    env.filters["fmt"] = lambda v, spec=".3f": format(v, spec) if isinstance(v, int | float) else ("" if v is None else v)
    env.filters["tojson_pretty"] = lambda v: json.dumps(v, indent=1, ensure_ascii=False, default=str)

    def render(template: str, **context) -> web.Response:
        return web.Response(text=env.get_template(template).render(run_name=run.path.name, **context),
                            content_type="text/html")

    @web.middleware
    async def require_token(request: web.Request, handler):
        if token is None:
            return await handler(request)
        given = request.query.get("token") or request.cookies.get(COOKIE)
        if given is None or not hmac.compare_digest(given.encode(), token.encode()):
            raise web.HTTPUnauthorized(text=f"this view needs its token: open the URL it printed (?token=...), "
                                            f"or set the same {TOKEN_ENV}")
        response = await handler(request)
        if "token" in request.query:
            response.set_cookie(COOKIE, token, httponly=True, samesite="Strict")
        return response

    async def index(request: web.Request) -> web.Response:
        from agentrl.report import heldout_curves, plot_svg, reward_curves

        # The report's own curves and charts (agentrl/report.py), drawn as SVG from what is written so far.
        phases, evals, steps = run.phases(), run.evaluations(), run.steps()
        metric, curves = heldout_curves(phases, evals)
        return render("index.html", phases=phases, evals=evals, steps=steps, metric=metric,
                      chart_heldout=plot_svg(f"Held-out {metric} (greedy)", curves, "minutes since the first evaluation"),
                      chart_reward=plot_svg("Reward terms", reward_curves(steps), "learner version (optimizer step)"),
                      num_groups=len(run.groups()))

    async def evaluation(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        episodes = run.eval_episodes(name)
        metric = score_metric(run)
        fields = sorted({f"{k}={v}" for e in episodes for k, v in e["fields"].items()})
        labels = sorted({label for e in episodes for label in failure_labels(e)})
        q = request.query
        shown = []
        for i, e in enumerate(episodes):
            s = float((e.get("metrics") or {}).get(metric, 0.0))
            if q.get("min_score") and s < float(q["min_score"]) or q.get("max_score") and s > float(q["max_score"]):
                continue
            if q.get("field") and q["field"] not in {f"{k}={v}" for k, v in e["fields"].items()}:
                continue
            if q.get("failure") and q["failure"] not in failure_labels(e):
                continue
            shown.append({"index": i, "score": s, "episode": e, "failures": failure_labels(e)})
        return render("eval.html", name=name, metric=metric, shown=shown, total=len(episodes), fields=fields,
                      labels=labels, query=dict(q))

    def episode_page(episode: dict, *, title: str, back: str, adv: list[float] | None, step: int | None,
                     trained: str) -> web.Response:
        segments, actions_seen = [], 0
        adv_pos = 0
        # A record of an older agentrl kept the text only.
        for segment in episode["segments"] or [{"kind": "prompt", "text": episode["text"]}]:
            if segment["kind"] == "action":
                n = len(segment.get("pieces", []))
                seg_adv = adv[adv_pos: adv_pos + n] if adv else None
                adv_pos += n
                segments.append({**segment, "tokens": token_spans(segment, seg_adv), "turn": actions_seen})
                actions_seen += 1
            else:
                segments.append(segment)
        return render("episode.html", title=title, back=back, episode=episode, segments=segments, step=step,
                      trained=trained, metric=score_metric(run))

    async def eval_episode(request: web.Request) -> web.Response:
        name, index = request.match_info["name"], int(request.match_info["index"])
        episodes = run.eval_episodes(name)
        if not 0 <= index < len(episodes):
            raise web.HTTPNotFound(text=f"evaluation {name} has {len(episodes)} episodes")
        return episode_page(episodes[index], title=f"{name}: episode {index}", back=f"/eval/{name}", adv=None, step=None,
                            trained="an evaluation episode (greedy, not trained)")

    async def rl_episode(request: web.Request) -> web.Response:
        line, index = int(request.match_info["line"]), int(request.match_info["index"])
        groups = run.groups()
        if not 0 <= line < len(groups) or not 0 <= index < len(groups[line]["episodes"]):
            raise web.HTTPNotFound(text="no such RL episode")
        group = groups[line]
        step = steps_of_groups(run).get(group["group_id"])
        advs = advantages(run, group, step)
        trained = (f"trained at step {step}" if step is not None else
                   "not trained (yet): dropped for equal rewards, refused, or still in the learner's queue")
        return episode_page(group["episodes"][index], title=f"group {group['group_id']}: episode {index}",
                            back=f"/step/{step}" if step is not None else "/", adv=advs[index] if advs else None,
                            step=step, trained=trained)

    async def step_page(request: web.Request) -> web.Response:
        step = int(request.match_info["step"])
        record = next((s for s in run.steps() if int(s["step"]) == step), None)
        if record is None:
            raise web.HTTPNotFound(text=f"no step {step} in rl/metrics.jsonl")
        wanted = set(record.get("group_ids", []))
        groups = [(i, g) for i, g in enumerate(run.groups()) if g.get("group_id") in wanted]
        return render("step.html", step=step, record=record, groups=groups)

    async def question(request: web.Request) -> web.Response:
        task_id = request.query.get("task_id", "")
        columns = []
        for e in run.evaluations():
            if e["name"] is None:
                continue
            for i, episode in enumerate(run.eval_episodes(e["name"])):
                if episode.get("task_id") == task_id:
                    columns.append({"eval": e, "index": i, "episode": episode,
                                    "segments": [{**s, "tokens": token_spans(s, None)} if s["kind"] == "action" else s
                                                 for s in episode["segments"] or [{"kind": "prompt", "text": episode["text"]}]]})
        if not columns:
            raise web.HTTPNotFound(text=f"no evaluation kept an episode of task {task_id!r}")
        return render("question.html", task_id=task_id, columns=columns, metric=score_metric(run))

    app = web.Application(middlewares=[require_token])
    app.add_routes([web.get("/", index), web.get("/eval/{name}", evaluation),
                    web.get("/episode/eval/{name}/{index:\\d+}", eval_episode),
                    web.get("/episode/rl/{line:\\d+}/{index:\\d+}", rl_episode),
                    web.get("/step/{step:\\d+}", step_page), web.get("/question", question)])
    return app


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="agentrl view", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a run directory (agentrl train --out), finished or running")
    parser.add_argument("--port", type=int, default=8765, help="port to serve on (0: any free port)")
    parser.add_argument("--host", default="127.0.0.1",
                        help=f"address to bind; other than loopback, requests need the token (${TOKEN_ENV}, else one is made and printed)")
    args = parser.parse_args(argv)
    token = None if is_loopback(args.host) else os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(24)
    try:
        app = make_app(Path(args.run_dir), token)
    except NotARun as err:
        print(f"agentrl view: {err}", file=sys.stderr)
        return 2
    runner = web.AppRunner(app)

    async def serve() -> None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await runner.setup()
        try:
            site = web.TCPSite(runner, args.host, args.port)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # the bound port when --port 0
            host = f"[{args.host}]" if ":" in args.host else args.host
            print(f"agentrl view: http://{host}:{port}/" + (f"?token={token}" if token else ""), flush=True)
            await stop.wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(serve())
    except OSError as err:  # the port is taken, the address not this host's
        print(f"agentrl view: cannot serve on {args.host}:{args.port}: {err}", file=sys.stderr)
        return 2
    return 0
