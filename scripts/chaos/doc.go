// Package chaos is the chaos suite: the whole pipeline as real processes, under faults injected
// at random moments from a seed, checked at the end against what the writer did.
//
// What runs: CouchDB (its own PouchDB Server on disk, installed from the pinned lock with
// `npm ci --ignore-scripts`, or any CouchDB at CHAOS_COUCHDB_URL); a three-node JetStream cluster
// of bin/nats-server processes with per-node stores, the streams installed with 3 replicas; two
// producers, two replicators (engines native and couchdb), two onchange consumers, all real
// processes of bin/ (the producers with hot feeds, one of them with only 4); a webhook sink in this process that checks Basic auth and fails or stalls a
// fraction of requests; a writer that creates, updates and deletes docs, adds conflicting
// revisions, resolves conflicts, and deletes and recreates dbs.
//
// Rules: a pattern replicator rule from every source db to its own target db (create_target), an
// on_change webhook rule (POST with $change, $db_name, $seq; password from the passwords file),
// a second one with "block": true on the first three source dbs, whose requests the sink answers
// only after 500ms (each change waits for its answer, so a db's backlog makes jobs that last
// several AckWaits and run through the faults), and an on_change subject rule publishing to
// SPIEGEL_CHANGES.
//
// Faults (plan.go): SIGKILL and restart of every kind of process — producers, both replicators,
// onchange consumers, the NATS node leading the work stream, the NATS node leading a durable
// consumer of the work stream (onchange or replicator: CONSUMER.INFO's cluster.leader), the
// JetStream meta leader, any NATS node, CouchDB (SIGKILL or SIGTERM of its own PouchDB Server; on
// an external server, which the run never restarts, an outage of the proxy the Spiegel processes
// reach it through); SIGSTOP/SIGCONT of a consumer for longer than AckWait; a stepdown of the
// leader of a work consumer ($JS.API.CONSUMER.LEADER.STEPDOWN.<stream>.<consumer>), as a rolling
// upgrade moves leaders (every run steps down both consumers' leaders and kills the node leading
// the onchange consumer: the default set, not opt-in; the onchange ones are aimed, blockjob.go:
// each waits until a block job of at least AckWait is in progress and strikes while its call is
// open, and the plan writes a burst into a block-rule db before it); the sink answering 500 or stalling for a
// while; the passwords file rewritten and SIGHUP sent to the consumers. Opt-in, off by default in
// the short and the long run (on the current code they fail runs): with CHAOS_PARTITIONS=1 network
// partitions of one process from NATS or from CouchDB, frozen (no byte moves, connections stay
// open) or cut (connections reset), through the process's own proxies (links.go, outage.go;
// without it no proxy is in the path); with CHAOS_STORE_LOSS=1 NATS storage loss: one node, or
// every node at once, SIGKILLed and restarted from a copy of its store taken seconds earlier. The
// nodes run as deployments/ runs them (sync_interval: always); storage loss is what no durable
// deployment meets, and is a detection check (gaps.go): the changes the stream and the mirror lost
// may stay missing when the loss was reported within one sweep interval (and two AckWaits) of the
// fault's end.
//
// Verdict (oracle.go, after the writer and the faults stop and the pipeline converges): every
// target holds exactly its source's docs and leaf revisions; every (rule, doc, final revision) was
// delivered to the webhook; the change stream holds every final revision, each db incarnation in
// feed order; no dead letter; no process crashed or is left running; no webhook password in any
// log; no db with webhook calls of two onchange instances in progress at once, whatever their
// rules (the calls' arrival and answer at the sink, by X-Spiegel-Instance, 5ms tolerance; a
// SIGSTOPped instance's call that the sink was still answering is excused: overlap.go); at least
// one aimed leader change of the onchange consumer begun inside a block job of at least AckWait
// (else the overlap verdict never met its case: the run fails saying why); every
// final revision of the block rule's dbs delivered to it; after storage loss, gaps in the stream
// and the mirror only when reported in time (gaps.go); with partitions, no webhook call by an
// onchange instance partitioned from NATS later than AckWait + the rule's timeout after its
// partition began (lease.go). Duplicates are counted and reported, not failures.
//
// Determinism: the plan (writer ops and faults) derives from the seed alone and is printed with
// its digest; a replay runs the same ops and faults at the same moments. Process timing is not
// deterministic (which node leads the stream or a consumer, which job a consumer holds when it is
// killed, how a fault slips while the previous one on the same resource lasts), so a replay
// repeats the schedule, not every interleaving.
//
// Run it: TestChaosShort (fixed seed, about a minute) runs in the test command; the long run is
// `make chaos SEED=42 DURATION=30m` (TestChaosLong with CHAOS_LONG=1). See scripts/README.md, "Chaos suite".
package chaos
