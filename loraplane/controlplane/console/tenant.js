// A tenant's adapters: the list, with what each name serves and the recent uploads (and why
// any was refused). One adapter's view is adapter.js.

import { call, session } from "./api.js";
import { h, table } from "./dom.js";
import { bytes, shortDigest, time } from "./format.js";

const enc = encodeURIComponent;

/** Whether the name follows its latest version (a control plane without `follow_latest`:
 * whether it serves the latest). */
export function followsLatest(adapter) {
  if (typeof adapter.follow_latest === "boolean") return adapter.follow_latest;
  return adapter.current_version === adapter.latest_version;
}

/** What the name serves: "follows latest" or "held at vN (latest vM)". */
export function serving(adapter) {
  if (adapter.current_version === null) return "no version";
  if (followsLatest(adapter)) return "follows latest";
  const latest = adapter.latest_version;
  return latest === adapter.current_version
    ? `held at v${adapter.current_version} (the latest)`
    : `held at v${adapter.current_version} (latest v${latest})`;
}

function state(adapter, running) {
  if (running.has(adapter.name)) return `ingesting a new upload; ${serving(adapter)}`;
  return serving(adapter);
}

/** "ignored: training_args.bin, optimizer.pt": the files of an upload beside the adapter that
 * the control plane did not open or store ("" when there were none). */
export function ignoredNote(files) {
  return Array.isArray(files) && files.length ? `ignored: ${files.join(", ")}` : "";
}

/** What became of an upload: stored, identical, in progress, or refused (with why). */
export function outcome(app, job) {
  if (job.status === "succeeded" && job.result) {
    const v = job.result.version.version;
    const done = job.result.created ? `stored as v${v}` : `identical to v${v}: nothing new stored`;
    const skipped = ignoredNote(job.result.ignored);
    return skipped ? `${done}; ${skipped}` : done;
  }
  if (job.status === "failed" && job.error) return app.reason(job.error.code, job.error.message);
  return job.status === "pending" ? "waiting to be ingested" : "being ingested";
}

async function uploadJobs() {
  try {
    return await call("GET", "v1/uploads");
  } catch (error) {
    if (error.status === 401) throw error;
    return []; // cluster mode ingests elsewhere: the list is the adapters' own
  }
}

function recentUploads(app, jobs) {
  const rows = [
    ...session.attempts().map((a) => ({ ...a, kind: "at once" })),
    ...jobs.map((j) => ({
      when: j.created_at,
      name: j.name,
      status: j.status,
      result: j.result,
      error: j.error,
      kind: "background",
    })),
  ].sort((a, b) => String(b.when).localeCompare(String(a.when)));
  if (!rows.length) return null;
  return h(
    "section",
    { "aria-labelledby": "recent-title" },
    h("h2", { id: "recent-title" }, "Recent uploads"),
    table(
      null,
      ["When", "Name", "Ingested", "Outcome"],
      rows.slice(0, 20).map((r) => [time(r.when), r.name, r.kind, outcome(app, r)]),
    ),
  );
}

/** #/adapters: the caller's adapters and its recent uploads. */
export async function adapters(app) {
  const [list, jobs] = await Promise.all([call("GET", "v1/adapters"), uploadJobs()]);
  const running = new Set(
    jobs.filter((j) => j.status === "pending" || j.status === "running").map((j) => j.name),
  );
  const rows = list.map((a) => {
    const v = a.current || {};
    return [
      h("a", { href: `#/adapters/${enc(a.name)}` }, a.name),
      a.base_model,
      a.current_version === null ? "" : `v${a.current_version} of ${a.latest_version}`,
      v.rank === undefined ? "" : String(v.rank),
      bytes(v.size_bytes),
      h("code", { title: v.digest || "" }, shortDigest(v.digest)),
      state(a, running),
      time(a.updated_at),
    ];
  });
  return h(
    "div",
    {},
    h("h1", {}, "Adapters"),
    list.length
      ? table(
          `${list.length} adapter${list.length === 1 ? "" : "s"} under this key's tenant`,
          ["Name", "Base model", "Version", "Rank", "Size", "Digest", "State", "Updated"],
          rows,
        )
      : h("p", {}, "No adapters yet. ", h("a", { href: "#/upload" }, "Upload one"), "."),
    recentUploads(app, jobs),
  );
}
