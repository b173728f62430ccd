// graphile-worker's drain, for `python -m bench peers` (bench/graphile.py starts it).
// N no-op jobs pre-loaded with one add_jobs call into a schema of the bench's
// own, then one runner drains them, timed from the first job's start to the
// last one's; the schema is dropped at the end. Prints one line:
//   graphile drain=<jobs/s> mode=<mode> jobs=<n> seconds=<s> left=<jobs left>
// Run with NODE_PATH naming the node_modules that holds graphile-worker:
//   NMBUS_BENCH_DSN=... node graphile_drain.js SCHEMA N MODE
// MODE default: concurrentJobs 1 (the library's default), no local queue;
// MODE tuned: the settings of graphile-worker's own performance page
// (concurrentJobs 24, maxPoolSize 25, localQueue 500, batch delays 0).
const { run, makeWorkerUtils, Logger } = require("graphile-worker");
const { Client, Pool } = require("pg");

async function main() {
  const [schema, nText, mode = "default"] = process.argv.slice(2);
  const dsn = process.env.NMBUS_BENCH_DSN;
  const n = Number(nText);
  if (!dsn || !schema || !(n >= 1)) throw new Error("usage: NMBUS_BENCH_DSN=... node graphile_drain.js SCHEMA N MODE");
  const pool = new Pool({ connectionString: dsn, max: 2 });
  pool.on("error", () => {});
  pool.on("connect", (client) => client.on("error", () => {}));
  const quiet = new Logger(() => () => {});
  const quoted = Client.prototype.escapeIdentifier(schema);
  try {
    await pool.query(`drop schema if exists ${quoted} cascade`);
    const utils = await makeWorkerUtils({ pgPool: pool, schema, logger: quiet });
    await utils.migrate();
    await pool.query(
      `select ${quoted}.add_jobs(array(select row('noop', json_build_object('i', g), null, null, null, null, null, null)::${quoted}.job_spec from generate_series(1, $1) g))`,
      [n],
    );
    await pool.query(`vacuum analyze ${quoted}._private_jobs`);
    const worker =
      mode === "tuned"
        ? { concurrentJobs: 24, maxPoolSize: 25, localQueue: { size: 500 }, completeJobBatchDelay: 0, failJobBatchDelay: 0 }
        : { concurrentJobs: 1 };
    let done = 0, t0 = 0n, finish;
    const finished = new Promise((r) => (finish = r));
    const runner = await run({
      connectionString: dsn,
      noHandleSignals: true,
      logger: quiet,
      preset: { worker: { ...worker, schema } },
      taskList: {
        noop: async () => {
          if (done === 0) t0 = process.hrtime.bigint();
          if (++done === n) finish(process.hrtime.bigint());
        },
      },
    });
    const t1 = await finished;
    // The last jobs are marked complete after their task returns: wait for that
    // before stopping the runner, which can otherwise give a job back unfinished
    // (seen: "drained 5000 of 5000; 1 left"). The timing above is already taken.
    const count = async () =>
      (await pool.query(`select count(*)::int c from ${quoted}._private_jobs`)).rows[0].c;
    const deadline = Date.now() + 30000;
    while ((await count()) > 0 && Date.now() < deadline) {
      await new Promise((r) => setTimeout(r, 20));
    }
    await runner.stop();
    const left = await count();
    await utils.release();
    const secs = Number(t1 - t0) / 1e9;
    console.log(`graphile drain=${Math.round(n / secs)} mode=${mode} jobs=${n} seconds=${secs.toFixed(3)} left=${left}`);
  } finally {
    await pool.query(`drop schema if exists ${quoted} cascade`).catch(() => {});
    await pool.end();
  }
}
function describe(e) {
  if (e && Array.isArray(e.errors) && e.errors.length) return e.errors.map(describe).join("; ");
  return String((e && (e.message || e.code)) || e || "an error without a message");
}
main().catch((e) => { console.error(describe(e)); process.exit(1); });
