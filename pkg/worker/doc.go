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
//   - Lost-wakeup check: a change that lands while a db's job runs is refused by the work stream
//     as a duplicate, and its offer leaves a wakeup marker (natsjs.Jobs.Offer). The runner clears
//     the db's marker when the job starts and takes it after the ack: a marker set during the
//     run makes the job run again (so does a marker that cannot be read). No CouchDB request is
//     made for it.
package worker
