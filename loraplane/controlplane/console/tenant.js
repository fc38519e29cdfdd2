// A tenant's adapters: the list (with recent uploads and why any was refused), and one
// adapter's versions and how to call it.

import { call, session } from "./api.js";
import { copyable, field, h, table } from "./dom.js";
import { bytes, shortDigest, time } from "./format.js";

const enc = encodeURIComponent;

function state(adapter, running) {
  if (running.has(adapter.name)) return "ingesting a new upload";
  if (adapter.current_version === null) return "no version";
  if (adapter.current_version === adapter.latest_version) return "serving";
  return `serving v${adapter.current_version}, pinned (latest v${adapter.latest_version})`;
}

/** What became of an upload: stored, identical, in progress, or refused (with why). */
export function outcome(app, job) {
  if (job.status === "succeeded" && job.result) {
    const v = job.result.version.version;
    return job.result.created ? `stored as v${v}` : `identical to v${v}: nothing new stored`;
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

function dataplaneUrl(app) {
  if (app.config.dataplane_url) return app.config.dataplane_url.replace(/\/+$/, "");
  return `${window.location.protocol}//${window.location.hostname}:8000`;
}

function snippets(url, model) {
  const body = JSON.stringify({ model, messages: [{ role: "user", content: "Hello!" }] });
  const curl = [
    `curl -s ${url}/v1/chat/completions \\`,
    '  -H "Authorization: Bearer $LORAPLANE_API_KEY" -H "Content-Type: application/json" \\',
    `  -d '${body.replaceAll("'", "'\\''")}'`,
  ].join("\n");
  const python = [
    "import os",
    "from openai import OpenAI",
    "",
    `client = OpenAI(base_url=${JSON.stringify(`${url}/v1`)}, api_key=os.environ["LORAPLANE_API_KEY"])`,
    "reply = client.chat.completions.create(",
    `    model=${JSON.stringify(model)},`,
    '    messages=[{"role": "user", "content": "Hello!"}],',
    ")",
    "print(reply.choices[0].message.content)",
  ].join("\n");
  return [copyable(curl, `curl for ${model}`), copyable(python, `Python for ${model}`)];
}

function howToCall(app, adapter) {
  const pinned = `${adapter.name}@${adapter.current_version}`;
  const url = h("input", { type: "url", value: dataplaneUrl(app), spellcheck: "false" });
  const model = h(
    "select",
    {},
    h("option", { value: adapter.name }, `${adapter.name} (the version it serves now)`),
    h("option", { value: pinned }, `${pinned} (always this version)`),
  );
  const out = h("div", {}, snippets(url.value, adapter.name));
  const update = () => out.replaceChildren(...snippets(url.value.replace(/\/+$/, ""), model.value));
  url.addEventListener("input", update);
  model.addEventListener("change", update);
  return h(
    "section",
    { "aria-labelledby": "call-title" },
    h("h2", { id: "call-title" }, "How to call it"),
    h(
      "p",
      {},
      "On the data plane's OpenAI API, ",
      h("code", {}, `model="${adapter.name}"`),
      ` uses the version it serves now (v${adapter.current_version}); `,
      h("code", {}, `model="${pinned}"`),
      " always that version. Set ",
      h("code", {}, "LORAPLANE_API_KEY"),
      " to your key first: the examples read it from the environment.",
    ),
    h(
      "div",
      { class: "row" },
      field("call-url", "Data plane URL", url),
      field("call-model", "Model", model),
    ),
    out,
  );
}

function notFound(name) {
  return h(
    "div",
    {},
    h("h1", {}, "Not found"),
    h("p", {}, `No adapter named “${name}” under this key.`),
    h("p", {}, h("a", { href: "#/adapters" }, "All adapters")),
  );
}

/** #/adapters/{name}: one adapter, its versions, and how to call it. Another tenant's adapter
 * is as absent here as in the API (404 either way). */
export async function adapter(app, name) {
  let a;
  let versions;
  try {
    [a, versions] = await Promise.all([
      call("GET", `v1/adapters/${enc(name)}`),
      call("GET", `v1/adapters/${enc(name)}/versions`),
    ]);
  } catch (error) {
    if (error.status === 404) return notFound(name);
    throw error;
  }
  const actions = h("div", {});
  const serve = (v) =>
    app.guard(async () => {
      await call("PATCH", `v1/adapters/${enc(a.name)}`, { current_version: v });
      app.notify(`${a.name} now serves v${v}.`);
      await app.refresh();
    }, actions);
  const rows = versions.map((v) => [
    `v${v.version}`,
    String(v.rank),
    String(v.alpha),
    v.target_modules.join(", "),
    bytes(v.size_bytes),
    v.base_model,
    h("code", { class: "digest" }, v.digest),
    time(v.created_at),
    v.created_by,
    v.version === a.current_version
      ? "serving"
      : h(
          "button",
          { type: "button", class: "secondary small", on: { click: serve(v.version) } },
          `Serve v${v.version}`,
        ),
  ]);
  return h(
    "div",
    {},
    h("p", { class: "crumbs" }, h("a", { href: "#/adapters" }, "Adapters"), " / "),
    h("h1", {}, a.name),
    h(
      "dl",
      { class: "facts" },
      h("dt", {}, "Base model"),
      h("dd", {}, a.base_model),
      h("dt", {}, "Serving"),
      h("dd", {}, a.current_version === null ? "no version" : `v${a.current_version}`),
      h("dt", {}, "Latest"),
      h("dd", {}, a.latest_version === null ? "" : `v${a.latest_version}`),
      h("dt", {}, "Updated"),
      h("dd", {}, time(a.updated_at)),
    ),
    a.current_version === null ? null : howToCall(app, a),
    h(
      "section",
      { "aria-labelledby": "versions-title" },
      h("h2", { id: "versions-title" }, "Versions"),
      actions,
      table(
        "Every version, oldest first; versions are immutable",
        ["Version", "Rank", "Alpha", "Targets", "Size", "Base model", "Digest", "Created", "By", ""],
        rows,
      ),
    ),
  );
}
