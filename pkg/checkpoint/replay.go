package checkpoint

import "strings"

// A checkpoint that `producer replay` reset carries a replay mark, the doc's replayed_at: the
// moment of the reset, then, when the store had a ReplayID, that id, then, once the replay
// reached the end of the feed, "done". The moment makes every reset a new mark (a run in flight
// from before it cannot save its progress, see Save); the id tells the rule's run which replay it
// is part of.
const replayDone = "done"

// replayMark is the mark of a reset at moment by replay id ("" = none).
func replayMark(moment, id string) string {
	if id == "" {
		return moment
	}
	return moment + " " + id
}

// Replay returns the replay that reset the checkpoint and whether it is still under way: the
// run that continues from this checkpoint is part of it until it reaches the end of the feed and
// calls EndReplay. id is "" when no replay with an id reset the checkpoint.
func (p OnChangePoint) Replay() (id string, active bool) {
	f := strings.Fields(p.replayed)
	if len(f) < 2 {
		return "", false
	}
	return f[1], len(f) == 2
}

// EndReplay marks the replay under way as finished; the next Save stores that. Later runs
// are not part of it any more.
func (p *OnChangePoint) EndReplay() {
	if _, active := p.Replay(); active {
		p.replayed += " " + replayDone
	}
}
