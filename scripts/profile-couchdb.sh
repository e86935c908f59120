#!/usr/bin/env bash
# Profiles a running Apache CouchDB node on this machine for PROF_SECONDS (30) while a benchmark
# runs against it, and writes what it found into PROF_OUT (profile-couchdb/):
#   - msacc.txt: what the node's threads did (Erlang's microstate accounting: emulator, port,
#     gc, other, sleep, per scheduler type; a dirty I/O scheduler's file operations and, without
#     an emulator built with extra states, its busy waiting count as "other");
#   - reductions.txt: the Erlang work by kind of process (reductions over the window, grouped by
#     the processes' initial calls: HTTP connections, db updaters, the log server…; processes
#     that ended within the window, such as fabric's short-lived workers, are not counted);
#   - perf-threads.txt and perf-symbols.txt, when perf is installed: CPU samples of the node's
#     threads (schedulers, dirty I/O schedulers) and the hottest symbols. Start CouchDB with
#     ERL_FLAGS="+JPperf true" for the JIT's Erlang functions to have names.
# Variables: COUCH_NODE (couchdb@127.0.0.1, the -name of the node's vm.args), COUCH_COOKIE (its
# -setcookie; required), PROF_SECONDS, PROF_OUT. Needs erl on the PATH of the node's OTP release:
# the probe sends the node a fun, which only the same release's erl_eval runs. It changes nothing
# on the node: msacc is switched on for the window and off
# again, and the reductions are read, not reset.
set -euo pipefail
node=${COUCH_NODE:-couchdb@127.0.0.1}
cookie=${COUCH_COOKIE:?set COUCH_COOKIE to the Erlang cookie of the node: -setcookie in its vm.args}
secs=${PROF_SECONDS:-30}
out=${PROF_OUT:-profile-couchdb}
mkdir -p "$out"
beam=$(pgrep -f "beam.smp.*-name ${node}( |$)" | head -1 || true)
perf_pid=
if [ -n "$beam" ] && command -v perf >/dev/null; then
  perf record -F 499 -g -p "$beam" -o "$out/perf.data" -- sleep "$secs" >"$out/perf-record.log" 2>&1 &
  perf_pid=$!
elif [ -z "$beam" ]; then
  echo "no beam.smp with -name $node on this machine: no perf profile" >&2
fi
# The Erlang side reads its parameters from the environment, so that the code stays quoted.
read -r -d '' probe <<'ERL' || true
N = list_to_atom(os:getenv("COUCH_NODE")),
Ms = list_to_integer(os:getenv("PROF_SECONDS")) * 1000,
Out = os:getenv("PROF_OUT"),
true = net_kernel:connect_node(N) orelse halt(2),
Snap = fun() -> rpc:call(N, erlang, apply, [fun() ->
    [{P, R, case proc_lib:translate_initial_call(P) of {M, F, A} -> {M, F, A}; _ -> unknown end}
     || P <- erlang:processes(), {reductions, R} <- [erlang:process_info(P, reductions)]] end, []]) end,
Self = self(),
spawn(fun() -> A = Snap(), timer:sleep(Ms), Self ! {reds, A, Snap()} end),
true = rpc:call(N, msacc, start, [Ms], Ms + 30000),
Stats = rpc:call(N, msacc, stats, []),
{ok, F1} = file:open(filename:join(Out, "msacc.txt"), [write]),
ok = rpc:call(N, msacc, print, [F1, Stats, #{system => true}]),
ok = file:close(F1),
receive {reds, Before, After} ->
    B0 = maps:from_list([{P, R} || {P, R, _} <- Before]),
    D = lists:foldl(fun({P, R, IC}, Acc) ->
            maps:update_with(IC, fun(V) -> V + R - maps:get(P, B0, 0) end, R - maps:get(P, B0, 0), Acc)
        end, #{}, After),
    L = lists:reverse(lists:keysort(2, maps:to_list(D))),
    Tot = lists:sum([V || {_, V} <- L]),
    {ok, F2} = file:open(filename:join(Out, "reductions.txt"), [write]),
    io:format(F2, "reductions over ~b s: ~b (processes that ended within the window are not counted)~n",
        [Ms div 1000, Tot]),
    [io:format(F2, "~6.2f %  ~p~n", [100 * V / max(Tot, 1), IC]) || {IC, V} <- lists:sublist(L, 30)],
    ok = file:close(F2)
end,
halt().
ERL
COUCH_NODE=$node PROF_SECONDS=$secs PROF_OUT=$out erl -name "profile$$@127.0.0.1" -setcookie "$cookie" -noshell -eval "$probe"
if [ -n "$perf_pid" ]; then
  wait "$perf_pid" || true
  perf report -i "$out/perf.data" --no-children --sort comm --stdio -g none 2>/dev/null |
    grep -v '^#' | grep . | awk '{c=$2; sub(/^[0-9]+_/, "", c); sub(/^dirty_io.*/, "dirty_io_scheduler", c); sub(/^dirty_cpu.*/, "dirty_cpu_scheduler", c); p=$1; sub("%", "", p); a[c] += p}
      END {for (k in a) printf "%6.2f %%  %s\n", a[k], k}' | sort -rn >"$out/perf-threads.txt"
  perf report -i "$out/perf.data" --no-children --sort comm,dso,sym --stdio -g none 2>/dev/null |
    grep -v '^#' | grep . | head -60 >"$out/perf-symbols.txt"
fi
echo "profile of $node over ${secs} s in $out/"
