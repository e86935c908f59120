// Package worker runs the jobs of one consumer group (replicate or onchange): it pulls work
// messages from the group's durable JetStream consumer with bounded concurrency, hands each one
// to a plain Handler as a Job, keeps it alive while the handler runs and settles it from the
// handler's result. Only this package touches JetStream messages (SPEC §5.1).
//
// Guarantees and contracts:
//
//   - At-least-once: a job is acknowledged only after its handler returned nil. A crash, a lost
//     connection or a shutdown past the grace period leads to a redelivery (after AckWait, or at
//     once for a nak), never to a lost job. Handlers must therefore be idempotent.
//   - At most one job per (group, db) runs at a time while its consumer is alive: the work
//     stream holds at most one message per subject, and that message stays pending until it is
//     acked or terminated. The runner adds no locks of its own for this.
//   - A job never exhausts its deliveries silently: the consumer has no MaxDeliver, and a job
//     is only ever terminated together with a dead-letter record.
//   - No prefetching: the runner never asks the server for more messages than it has free
//     handler slots, so a job's AckWait only starts when a slot is ready to run it.
//   - Leases: a running job's lease is renewed only by an InProgress the server confirmed (sent
//     as a request), and runs AckWait minus a tenth from when that InProgress was sent, so it
//     ends before JetStream can redeliver the job. When it runs out the handler's context is
//     cancelled with ErrLeaseLost and Held turns false; the job is left unsettled.
//   - Lost-wakeup check: a change that lands while a db's job is pending or running is refused
//     as a duplicate, and its offer leaves a wakeup marker (natsjs.Jobs.Offer). After a job is
//     acked or terminated the runner reads the db's marker (one API request): a marker, or a
//     failure to read it, enqueues the job again, and the run of a job enqueued for a marker
//     deletes that marker; so does a redelivered job for the marker it reads when it starts. A
//     marker is never deleted before a job covering it is stored; markers left behind by a
//     worker that died in between are enqueued by the runner's sweep. No CouchDB request is
//     made for it.
package worker
