"""fo.torch's `overlap=True`: measured, so that overlapping is never slower than not.

Handing gradients over during backward is not free: fo keeps an undo record of every early
step (a copy of the parameter and its state) so that the result has `overlap=False`'s bits,
and that copy can cost more than the overlap hides. Measured on an NVIDIA H200 machine (16
host cores, torch 2.11, FSDP2 + CPUOffloadPolicy, 12 x Linear(2048) = 50.4M params, quant8
state, `scripts/bench_fsdp2_overlap.py --rounds 3`): 33.87 ms per iteration overlapped
against 30.52 ms without (1.11x; a second run 1.197x), undo high-water 269.6 MiB. Whether it
pays depends on the machine and the loop, so the loop's own iterations decide:

- warm-up: the first `WARM_UP` iterations that hand a gradient over in backward are not
  timed (compilation, the allocator, autotuning, the undo records' first pages);
- probe: iterations without hand-over (the hooks hand nothing over and `step()` is the
  plain step, no undo record) alternate with overlapped ones (so that both kinds see the
  same drift of the machine's load) until `PAIRS` of each are timed. An iteration is the
  wall time from one `step()`'s return to the next one's, so gradient-accumulation
  micro-batches belong to the iteration their `step()` closes, and an asynchronous device
  is timed by the rate it lets the loop run at;
- decision: if the median overlapped iteration (a median: one iteration stretched by an
  evaluation or a checkpoint does not decide) is slower than the median plain one, the
  hooks stop handing over for good (fo._torch_overlap's `_deferred`, with one warning);
  otherwise they keep handing over. Never measured again.

An iteration whose step was skipped or failed (GradScaler found inf/NaN, an error) or whose
early steps were put back (`zero_grad()` without `step()`, a forward or a state read between
backward and `step()`, gradients edited after hand-over) is not timed: it costs what the
loop did, not what overlapping costs. An overlapped iteration in which backward handed
nothing over (the cores rule, CUDA gradients whose hooks ran on another stream than the
step's, gradients set by hand) is not timed either, and not counted against the probe.
After `DISCARD_LIMIT` iterations left out the probe decides with what it has, and without
both kinds timed it stops handing over: a loop that keeps putting early steps back only
pays for them.

The decision is the machine's and the loop's, not training state: `state_dict()` does not
carry it; a new optimizer, a deep copy or an unpickled one measures again.

Only fo._torch_overlap imports this module; it needs no torch."""
import statistics
import time

WARM_UP = 3  # overlapped iterations not timed
PAIRS = 3  # timed iterations of each kind
DISCARD_LIMIT = 4 * PAIRS  # iterations left out before the probe decides with what it has

_clock = time.perf_counter  # read once per step() return; tests inject their own

HELD = ("probe: this iteration hands nothing over and is timed against overlapped ones "
        "(overlap=True measures which is faster; overlap='always' does not)")


def _ms(seconds):
    ms = seconds * 1e3
    return f"{ms:.1f} ms" if ms >= 1 else f"{ms:.3f} ms"


class Probe:
    """The measurement of one optimizer: which kind of iteration runs now (`hands_over`),
    what was timed, and the decision."""

    def __init__(self):
        self.phase = "warm-up"  # then "probing", "decided", or "stopped" (the hooks were held for another reason)
        self.hands_over = True  # whether the iteration running now hands gradients over
        self.warmed = 0
        self.times = {True: [], False: []}  # seconds per timed iteration, by hands_over
        self.discarded = 0
        self.decision = None  # "overlap" or "no hand-over"
        self._since = None  # the clock at the last step() return
        self._spoilt = False  # the running iteration put early steps back or did not step

    def spoil(self):
        self._spoilt = True

    def stop(self):
        """The hooks no longer hand over for another reason (gradients edited after hand-over
        in two steps in a row): nothing left to measure."""
        if self.phase in ("warm-up", "probing"):
            self.phase = "stopped"

    def holding(self):
        """Why the running iteration hands nothing over, when the probe holds it back."""
        return HELD if self.phase == "probing" and not self.hands_over else None

    def step_returned(self, handed):
        """`step()` returned, closing an iteration in which backward handed `handed` gradients
        over. Returns why the hooks must stop handing over when the probe has just decided
        so, else None."""
        now, since, spoilt = _clock(), self._since, self._spoilt
        self._since, self._spoilt = now, False
        if self.phase == "warm-up":
            self.warmed += handed > 0
            if self.warmed >= WARM_UP:
                self.phase, self.hands_over = "probing", False
            return None
        if self.phase != "probing" or (self.hands_over and not handed and not spoilt):
            return None  # decided, or an overlapped iteration that had nothing to overlap
        if spoilt:
            self.discarded += 1
            return self._decide() if self.discarded >= DISCARD_LIMIT else None
        self.times[self.hands_over].append(now - since)
        if all(len(t) >= PAIRS for t in self.times.values()):
            return self._decide()
        if len(self.times[not self.hands_over]) < PAIRS:
            self.hands_over = not self.hands_over
        return None

    def _decide(self):
        self.phase = "decided"
        over, plain = self.times[True], self.times[False]
        if over and plain and statistics.median(over) <= statistics.median(plain):
            self.decision, self.hands_over = "overlap", True
            return None
        self.decision, self.hands_over = "no hand-over", False
        if not (over and plain):
            return (f"measured: {self.discarded} iterations were left out (early steps put back, or the step "
                    f"skipped) before {'overlapped ones' if not over else 'ones without hand-over'} could be timed")
        return (f"measured: overlapped iterations {_ms(statistics.median(over))} (median of {len(over)}) vs "
                f"{_ms(statistics.median(plain))} without hand-over (median of {len(plain)})")

    def stats(self):
        """`last_step_stats["overlap_probe"]`."""
        return {"phase": self.phase, "warmed_up": self.warmed,
                "overlapped_ms": [round(t * 1e3, 3) for t in self.times[True]],
                "plain_ms": [round(t * 1e3, 3) for t in self.times[False]],
                "discarded": self.discarded, "decision": self.decision}


class Measured:
    """Mixed into fo._torch_overlap's Overlap (which provides `_deferred`, `_warn_once` and
    `last_step_stats`): `overlap=True` probes, `overlap="always"` does not."""

    def _measure_init(self, overlap):
        self._probe = Probe() if overlap is True else None
        self._undo_released = False

    def _probe_hands_over(self):
        return self._probe is None or self._probe.hands_over

    def _probe_held(self):
        return None if self._probe is None else self._probe.holding()

    def _probe_spoil(self):
        if self._probe is not None:
            self._probe.spoil()

    def _after_step(self, stepped):
        """`step()` returns (`stepped`: False when it was skipped or raised): the probe times
        the iteration it closed, and may stop the hand-over for good."""
        probe = self._probe
        if probe is not None:
            self._probe_after_step(probe, stepped)
        self._release_undo_once_stopped()

    def _probe_after_step(self, probe, stepped):
        if not stepped:
            probe.spoil()
        if self._deferred is not None:
            probe.stop()
        reason = probe.step_returned(self.last_step_stats["handed_over_in_backward"] if stepped else 0)
        if reason is not None:
            self._deferred = reason
            self._warn_once("measured", f"fo.torch overlap=True: {reason}, so from now on gradients are handed "
                            "over at optimizer.step() (the cost of overlap=False). To hand over in every "
                            "backward regardless, pass overlap='always'.")
        if stepped:
            self.last_step_stats["overlap_probe"] = probe.stats()

    def _release_undo_once_stopped(self):
        """Once the hooks hand nothing over for good (`_deferred`: measured slower, or
        gradients edited in two steps in a row), fo's undo records kept for the next
        overlapped step are freed: as large as the parameters last stepped early plus their
        state (269.6 MiB for 50.4M parameters in the H200 run), held for nothing. Their size
        is `last_step_stats["undo_released_bytes"]` of that step."""
        if self._deferred is None or self._undo_released or self._fo is None or self._open:
            return
        self._undo_released = True
        released = self._fo.release_undo()
        if self.last_step_stats is not None:
            self.last_step_stats["undo_released_bytes"] = released
