"""`gputrace top`: a thin App. It runs the source in a thread worker, hands frames to its screens,
and runs actions in thread workers; everything blocking happens off the event loop."""

from __future__ import annotations

import dataclasses

from textual import work
from textual.app import App, SystemCommand
from textual.binding import Binding

from gputrace.base.errors import GputraceError
from gputrace.tracer.audit import DEFAULT_PRESET, PRESETS

from gputrace.base.procs import stat_fields
from gputrace.hostview.checkpoints import JOB_ACTIONS, PICKS, ActionResult, Checkpointer, ShimState, label
from .messages import ActionDone, ActionFailed, ActionProgress, FrameArrived, SourceEnded
from gputrace.hostview.model import Checkpoint, HostSnapshot, ProcessRow
from .screens.dialogs import ConfirmScreen, HelpScreen, RestoreScreen
from .screens.main import MainScreen
from gputrace.hostview.recording import Source

QUESTIONS = {
    "checkpoint_full": "Checkpoint pid {pid} ({comm}) whole, GPU and CPU state (CRIU), so that r can bring it back to "
                       "this point? It is frozen until the dump is written, then runs on.",
    "restore_full": "Bring pid {pid} ({comm}) back to {ckpt}? The running process is ended and the checkpoint's runs in "
                    "its place (GPU and CPU state, same pid): everything it did since is undone; a log it wrote since "
                    "is cut back to then and kept whole beside it.",
    "checkpoint": "Checkpoint only the device memory of pid {pid} ({comm})? It is frozen while that is copied out. Such "
                  "a checkpoint comes back only by a device-only rollback (R), safe only for programs that do not "
                  "reallocate; c checkpoints the whole process.",
    "rollback": "UNSAFE for most jobs: roll back only the device memory of pid {pid} ({comm}) to {ckpt}? Its host "
                "state goes on: if it allocated, freed or reused device memory since (a training loop does, every "
                "step), the job may crash or compute with stale data. gputrace refuses where it sees that, but cannot "
                "see everything; r (whole process) is the safe restore.",
    "suspend": "Suspend pid {pid} ({comm})? Its device memory is moved off the GPU (into host memory) and the job "
               "waits at its next GPU call until u resumes it; it stays suspended if top quits.",
    "resume": "Resume pid {pid} ({comm})? Its device memory is brought back to the GPU and the job goes on from "
              "where it waited.",
    "suspend_job": "Suspend the whole job of pid {pid} ({comm}): its {n} ranks, pids {pids}? Every rank is stopped at "
                   "the same collective and its device memory moved off the GPU; the job waits until u resumes it "
                   "(it stays suspended if top quits).",
    "resume_job": "Resume the job of pid {pid} ({comm}): its suspended ranks, pids {pids}, all at once? Their device "
                  "memory comes back and the job goes on from the collective where it stopped.",
}
# Said before a restore of a process that is suspended now.
SUSPENDED_RESTORE = (" It is suspended now: the checkpoint's process runs in its place, not suspended, and the "
                     "suspended one's data are dropped.")
# gputrace's actions in the command palette, with what each does.
PALETTE_ACTIONS = (
    ("checkpoint_full", "Checkpoint the selected process whole, GPU and CPU state (CRIU), left running"),
    ("restore_full", "Bring the selected process back to a whole-process checkpoint (it replaces the running one)"),
    ("suspend", "Move the selected process's device memory off the GPU (a rank: every rank of its job)"),
    ("resume", "Bring a suspended process's device memory back (a rank: every rank of its job)"),
    ("checkpoint", "Checkpoint only the selected process's device memory (for a device-only rollback)"),
    ("rollback", "UNSAFE for most jobs: roll back device memory alone, host state going on (refused where unsafe)"),
)
# Actions that need the shim in the job; the rest go through the driver's checkpoint API and CRIU.
NEEDS_SHIM = frozenset({"checkpoint", "rollback", "suspend", "resume"})
# What a job of several processes (ranks) needs instead of one key on one rank: its peers would wait
# in their collectives for a rank held alone, or run on out of step with one brought back alone.
# s and u act on the whole job from top (JOB_ACTIONS); the others refuse and name these.
JOB_COMMANDS = {
    "checkpoint_full": "gputrace checkpoint --full --tree LAUNCHER --leave-running -o DIR",
    "restore_full": "gputrace restore --full DIR (once the job has ended)",
    "checkpoint": "gputrace checkpoint --tree LAUNCHER -o DIR",
    "rollback": "gputrace restore DIR --device-only --force (unsafe)",
    "suspend": "gputrace suspend --tree LAUNCHER",
    "resume": "gputrace resume --tree LAUNCHER",
}


def job_command(action: str, pids: list[int]) -> str:
    """JOB_COMMANDS[action] for these ranks: their launcher named where they have one parent."""
    parents = {(stat_fields(p) or [b"", b"?"])[1] for p in pids if p > 0}
    cmd = JOB_COMMANDS[action]
    if len(parents) == 1 and (ppid := parents.pop()).isdigit() and int(ppid) > 1:
        cmd = cmd.replace("LAUNCHER", ppid.decode())
    return cmd


class TopApp(App):
    TITLE = "gputrace top"
    BINDINGS = [Binding("q", "quit", "quit"), Binding("question_mark", "help", "help"),
                Binding("ctrl+s", "screenshot_file", "screenshot", show=False)]

    def __init__(self, source: Source, checkpointer: Checkpointer, preset: str = DEFAULT_PRESET) -> None:
        super().__init__()
        self.source = source
        self.checkpointer = checkpointer
        self.preset = preset
        self.frame: HostSnapshot | None = None
        self.frames_seen = 0
        self.ended = False
        self.state = ""
        self.busy: dict[int, str] = {}               # pid -> the action running on it
        self._holds: dict[int, list[int]] = {}       # a job's action: the row's pid -> every rank it holds busy
        self.last_results: list[ActionResult | ActionFailed] = []
        self._checkpoints: dict[int, Checkpoint] = {}  # taken here, until the source lists them

    def on_mount(self) -> None:
        self.push_screen(MainScreen())
        self.read_source()

    def on_unmount(self) -> None:
        self.source.close()

    # --- the source --------------------------------------------------------------------------
    @work(thread=True, exclusive=True, group="source")
    def read_source(self) -> None:
        try:
            for frame in self.source.frames():
                self.post_message(FrameArrived(frame))
        except GputraceError as exc:
            self.post_message(SourceEnded(exc.msg, exc.hint))
            return
        except Exception as exc:  # the tracer failing must not take the screen with it
            self.post_message(SourceEnded(f"{type(exc).__name__}: {exc}", "report this with the message above"))
            return
        self.post_message(SourceEnded())

    def on_frame_arrived(self, msg: FrameArrived) -> None:
        self.frame = msg.frame
        self.frames_seen += 1
        self._refresh_screens()

    def on_source_ended(self, msg: SourceEnded) -> None:
        self.ended = True
        if msg.error:
            self.state = f"tracing stopped: {msg.error}"
            self.notify(f"{msg.error}\n{msg.hint}", title="tracing stopped", severity="error", timeout=30)
        else:
            self.state = "replay ended" if not self.source.live else "source ended"
        self._refresh_screens()

    def _refresh_screens(self) -> None:
        for screen in self.screen_stack:
            show = getattr(screen, "show_frame", None)
            if show is not None:
                show(self.frame)

    def with_overrides(self, row: ProcessRow) -> ProcessRow:
        """A row with the checkpoint taken here if the source does not list a newer one yet."""
        mine = self._checkpoints.get(row.pid)
        if mine and (row.last_checkpoint is None or row.last_checkpoint.taken_at < mine.taken_at):
            return dataclasses.replace(row, last_checkpoint=mine)
        return row

    def next_preset(self) -> None:
        names = list(PRESETS)
        self.preset = names[(names.index(self.preset) + 1) % len(names)]
        self.notify(f"overhead predicted for the {self.preset} preset: {PRESETS[self.preset].cost_source}",
                    title=f"preset {self.preset}", timeout=4)
        self._refresh_screens()

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    # --- the command palette -------------------------------------------------------------------
    def get_system_commands(self, screen):
        """Textual's commands (its Screenshot replaced by one that says where it saved), then
        gputrace's: the actions on the selected process, the preset, the help."""
        for c in super().get_system_commands(screen):
            if c.title != "Screenshot":
                yield c
        yield SystemCommand("Screenshot", "Save an SVG of the screen (the path is shown)", self.action_screenshot_file)
        if hasattr(screen, "action_act"):
            for action, what in PALETTE_ACTIONS:
                yield SystemCommand(label(action).capitalize(), what, lambda a=action: screen.action_act(a))
        yield SystemCommand("Next preset", "Predict the overhead for the next interception preset", self.next_preset)
        yield SystemCommand("Help", "Keys and what the columns mean", self.action_help)

    def action_screenshot_file(self) -> None:
        """An SVG of the screen in the working directory (or the temporary one, if that cannot be
        written), and a notification of where."""
        import os
        import tempfile

        where = os.getcwd() if os.access(os.getcwd(), os.W_OK) else tempfile.gettempdir()
        try:
            path = self.save_screenshot(path=where)
        except OSError as exc:
            self.notify(f"could not save a screenshot in {where}: {exc.strerror}", severity="error")
            return
        self.notify(f"screenshot saved to {path}", title="screenshot", timeout=8)

    # --- actions -----------------------------------------------------------------------------
    def _status(self, text: str) -> None:
        for screen in self.screen_stack:
            if isinstance(screen, MainScreen):
                screen.set_status(text)

    def request_action(self, action: str, row: ProcessRow) -> None:
        """Checks, asks, then runs `action` on the row's process in a worker. What cannot go right is refused
        here, before anything is asked or touched: s and u on a rank of a job act on every rank of it."""
        if not row.shimmed and action in NEEDS_SHIM:
            self.notify(f"pid {row.pid} ({row.comm}) runs without the shim; start it with "
                        "`gputrace run --checkpointable -- COMMAND` to checkpoint it", title=f"cannot {action}",
                        severity="warning")
            return
        peers = self._peers(row)
        pids = [row.pid, *peers]
        busy = [p for p in pids if p in self.busy]
        if busy:
            self.notify(f"pid {busy[0]} is busy: {label(self.busy[busy[0]])} in progress", severity="warning")
            return
        if peers and (action not in JOB_ACTIONS or -1 in peers):
            shown = [p for p in peers if p > 0]
            of = f"{row.job.world}" if -1 in peers and row.job.world else f"{len(pids)}"
            seen = f" (top sees {len(shown) + 1} of them)" if -1 in peers else ""
            with_ = f" (with {', '.join(map(str, shown[:4]))})" if shown else ""
            self._failed(ActionFailed(row.pid, action, f"pid {row.pid} is a rank of a job of {of} processes{with_}{seen}: "
                                      f"{label(action)} of one rank alone would leave the others waiting for it, or "
                                      "running on out of step with it",
                                      f"act on the whole job from a shell: `{job_command(action, pids)}`"
                                      + ("; s and u in top act on every rank once top sees them all" if action in
                                         JOB_ACTIONS else "")))
            return
        if not self.checkpointer.available(JOB_ACTIONS[action] if peers else action):
            self._failed(ActionFailed(row.pid, action, f"{label(action)} is not available yet",
                                      "it arrives with the checkpointer (issue 5)"))
            return
        states = self._states(pids) if row.shimmed else {}
        refused = self._refusal(action, row, pids, states)
        if refused is not None:
            self._failed(ActionFailed(row.pid, action, *refused))
            return
        fmt = {"pid": row.pid, "comm": row.comm}
        if peers:
            if action == "resume":  # the ranks suspended (those whose shim did not answer too: gang checks them)
                pids = [p for p in pids if states.get(p) is None or states[p].suspended]
            self._ask_job(JOB_ACTIONS[action], row, pids, fmt)
            return
        if action in PICKS:
            st = states.get(row.pid)
            self._pick_checkpoint(action, row, {**fmt, "suspended": bool(st and st.suspended)})
            return

        def answered(yes: bool | None) -> None:
            if yes:
                self.start_action(action, row.pid)

        question = QUESTIONS[action].format(**fmt)
        dest = getattr(self.checkpointer, "destination", lambda action, pid: None)(action, row.pid)
        if dest:
            question += f" Into {dest}"
        self.push_screen(ConfirmScreen(question), answered)

    def _ask_job(self, action: str, row: ProcessRow, pids: list[int], fmt: dict) -> None:
        def answered(yes: bool | None) -> None:
            if yes:
                self.start_action(action, row.pid, pids=pids)

        self.push_screen(ConfirmScreen(QUESTIONS[action].format(n=len(pids), pids=", ".join(map(str, pids)), **fmt)),
                         answered)

    def _states(self, pids: list[int]) -> dict[int, ShimState | None]:
        """Each shim's word on its process, read at the key (a shim answers at once; one that does not is
        not known, and the action itself checks again)."""
        read = getattr(self.checkpointer, "shim_state", None)
        return {p: read(p) if read is not None else None for p in pids}

    def _refusal(self, action: str, row: ProcessRow, pids: list[int], states: dict) -> tuple[str, str] | None:
        """(error, hint) where `action` cannot go right on the process (or job) as its shim describes it."""
        pid, st = row.pid, states.get(row.pid)
        if len(pids) > 1:
            suspended = [p for p in pids if states.get(p) is not None and states[p].suspended]
            if action == "suspend" and suspended:
                return (f"the job of pid {pid} is suspended already (pids {', '.join(map(str, suspended))})",
                        "u resumes it")
            if action == "resume" and not suspended and all(states.get(p) is not None for p in pids):
                return (f"no rank of the job of pid {pid} is suspended (pids {', '.join(map(str, pids))}): nothing "
                        "to resume", "s suspends the whole job")
            return None
        if st is None:
            return None
        if st.collectives and not row.job.key:
            return (f"pid {pid} has launched {st.collectives} collectives: it is a rank of a job of several processes "
                    f"whose peers top cannot tell (no launcher's RANK and WORLD_SIZE, nor GPUTRACE_JOB, in its "
                    f"environment); {label(action)} of one rank alone would leave the others waiting for it, or running "
                    "on out of step with it",
                    f"act on the whole job from a shell: `{job_command(action, pids)}`; a single process that drives "
                    f"several GPUs itself is a job of one: act on it from a shell with -p {pid}")
        if action == "resume" and not st.suspended:
            return f"pid {pid} is not suspended: nothing to resume", "s suspends it"
        if action == "suspend" and st.suspended:
            return f"pid {pid} is suspended already", "u resumes it"
        if st.suspended and action in ("checkpoint_full", "checkpoint", "rollback"):
            return (f"pid {pid} is suspended: its device memory is off the GPU, so no {label(action)} can be taken "
                    "of it or made in it now", f"u resumes it first (the job goes on where it waited), then "
                    f"{ {'checkpoint_full': 'c', 'checkpoint': 'C', 'rollback': 'R'}[action]}")
        return None

    def _peers(self, row: ProcessRow) -> list[int]:
        """The other processes of the job `row` is a rank of (empty: it is no rank of a job of several;
        -1 among them: its launcher says there are more than top shows)."""
        if not row.job.key:
            return []
        peers = sorted(r.pid for r in (self.frame.processes if self.frame else ()) if r.job.key == row.job.key
                       and r.pid != row.pid)
        if (row.job.world or 1) > len(peers) + 1:
            peers.append(-1)  # its launcher says there are more, not shown here
        return peers

    @work(thread=True, group="actions")
    def _pick_checkpoint(self, action: str, row: ProcessRow, fmt: dict) -> None:
        try:
            cks = getattr(self.checkpointer, PICKS[action])(row.pid)
        except GputraceError as exc:
            self.post_message(ActionFailed(row.pid, action, exc.msg, exc.hint))
            return
        self.call_from_thread(self._ask_restore, action, row, fmt, cks)

    def _ask_restore(self, action: str, row: ProcessRow, fmt: dict, cks: list[Checkpoint]) -> None:
        if not cks:
            kind, key = ("whole-process", "c") if action == "restore_full" else ("device-memory", "C")
            self._failed(ActionFailed(row.pid, action, f"pid {row.pid} has no {kind} checkpoint to {label(action)} to",
                                      f"take one first with {key}"))
            return

        def confirmed(ck_id: str, yes: bool | None) -> None:
            if yes:
                self.start_action(action, row.pid, ck_id)

        def picked(ck_id: str | None) -> None:
            if ck_id:
                question = QUESTIONS[action].format(ckpt=ck_id, **fmt)
                if fmt.get("suspended"):
                    question += SUSPENDED_RESTORE
                self.push_screen(ConfirmScreen(question), lambda yes: confirmed(ck_id, yes))

        self.push_screen(RestoreScreen(row.pid, row.comm, cks, whole=action == "restore_full"), picked)

    def start_action(self, action: str, pid: int, arg: str | None = None, pids: list[int] | None = None) -> None:
        """`action` on `pid` in a worker; a job's action (`pids`, its ranks, `pid` the row's) holds every rank busy."""
        for p in pids or [pid]:
            self.busy[p] = action
        if pids:
            self._holds[pid] = list(pids)
        self._status(f"{label(action)} of pid {pid}: starting ...")
        self._action_worker(action, pid, arg, pids)

    @work(thread=True, group="actions")
    def _action_worker(self, action: str, pid: int, arg: str | None, pids: list[int] | None = None) -> None:
        def progress(fraction: float, text: str) -> None:
            self.post_message(ActionProgress(pid, action, fraction, text))

        try:
            fn = getattr(self.checkpointer, action)
            if pids is not None:
                result = fn(pids, progress)
            else:
                result = fn(pid, arg, progress) if action in PICKS else fn(pid, progress)
        except GputraceError as exc:
            self.post_message(ActionFailed(pid, action, exc.msg, exc.hint))
            return
        except Exception as exc:  # whatever the checkpointer does, the dashboard stays up
            self.post_message(ActionFailed(pid, action, f"{label(action)} failed: {type(exc).__name__}: {exc}"))
            return
        self.post_message(ActionDone(result))

    def on_action_progress(self, msg: ActionProgress) -> None:
        # The checkpointer's line has its bar, share, rate and time left; a bare text gets the share.
        text = msg.text if "%" in msg.text else f"{100 * msg.fraction:.0f}% {msg.text}".rstrip()
        self._status(f"{label(msg.action)} of pid {msg.pid}: {text}")

    def _unbusy(self, pid: int) -> None:
        """`pid` and the ranks its action holds (a job's) free for the next."""
        for p in self._holds.pop(pid, [pid]):
            self.busy.pop(p, None)

    def on_action_done(self, msg: ActionDone) -> None:
        r = msg.result
        self._unbusy(r.pid)
        self.last_results.append(r)
        if r.checkpoint is not None:
            self._checkpoints[r.pid] = r.checkpoint
        froze = f", froze the job {r.freeze_s * 1e3:.1f} ms" if r.freeze_s is not None else ""
        back = f", back in {r.back_s:.2f} s" if r.back_s is not None else ""
        text = f"{label(r.action)} of pid {r.pid} done{froze}{back}: {r.message}"
        self._status(text)
        self.notify(text, title=f"{label(r.action)} done", timeout=6)
        self._refresh_screens()

    def on_action_failed(self, msg: ActionFailed) -> None:
        self._failed(msg)

    def _failed(self, msg: ActionFailed) -> None:
        self._unbusy(msg.pid)
        self.last_results.append(msg)
        self._status(f"{label(msg.action)} of pid {msg.pid} FAILED: {msg.error}")
        self.notify(f"{msg.error}\n{msg.hint}" if msg.hint else msg.error, title=f"{label(msg.action)} failed",
                    severity="error", timeout=10)
