// One of a tenant's adapters: what it serves and the actions that change that (serve a
// version, roll back, follow latest, a weighted rollout (rollout.js), delete; each asked
// first), its versions, and how to call it.

import { call } from "./api.js";
import { confirm } from "./confirm.js";
import { copyable, field, h, table } from "./dom.js";
import { bytes, time } from "./format.js";
import { rolloutControls, rolloutFact } from "./rollout.js";
import { followsLatest } from "./tenant.js";

const enc = encodeURIComponent;

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

/** The adapter's name with `answer`'s state, as a notice: "faq now serves v1, held." */
function served(answer) {
  const how = followsLatest(answer)
    ? "following the latest version"
    : "held until you choose again";
  return `${answer.name} now serves v${answer.current_version}, ${how}.`;
}

/** The version before the current one (what Roll back serves), or null. */
function previous(a, versions) {
  if (a.current_version === null) return null;
  const older = versions.map((v) => v.version).filter((n) => n < a.current_version);
  return older.length ? Math.max(...older) : null;
}

/** The buttons that change what the name serves, or delete it; `place` shows their errors.
 * `serve(v)` is the handler of a version row's "Serve vN". */
function actions(app, a, versions, place) {
  const path = `v1/adapters/${enc(a.name)}`;
  const held = "New uploads are stored but not served meanwhile.";
  const use = (v) => `Requests to ${a.name} will use v${v}`;
  // ask, then PATCH current_version (a number holds it, null follows the latest)
  const patch = (version, ask) =>
    app.guard(async () => {
      if (!(await confirm(ask))) return;
      app.notify(served(await call("PATCH", path, { current_version: version })));
      await app.refresh();
    }, place);
  const serve = (v) =>
    patch(v, {
      question: `Serve v${v} of ${a.name}?`,
      consequence: `${use(v)} until you choose again. ${held}`,
      action: `Serve v${v}`,
    });
  const before = previous(a, versions);
  const rollback = patch(before, {
    question: `Roll back ${a.name} to v${before}?`,
    consequence:
      `${use(before)} until you choose again (it serves v${a.current_version} now). ${held}`,
    action: `Roll back to v${before}`,
  });
  const follow = patch(null, {
    question: `Follow the latest version of ${a.name}?`,
    consequence: `${use(a.latest_version)} now, and each new version as soon as an upload stores it.`,
    action: "Follow latest",
  });
  const kept =
    versions.length === 1 ? "Its stored version is" : `Its ${versions.length} stored versions are`;
  const remove = app.guard(async () => {
    const yes = await confirm({
      question: `Delete ${a.name}?`,
      consequence:
        `Requests to ${a.name} will be refused from now on, and it leaves your adapters ` +
        `(and your adapter quota). ${kept} kept, not served.`,
      action: `Delete ${a.name}`,
      danger: true,
    });
    if (!yes) return;
    await call("DELETE", path);
    app.notify(`${a.name} deleted: it is no longer served.`);
    window.location.hash = "#/adapters";
  }, place);
  const button = (id, text, handler, kind = "secondary") =>
    h("button", { type: "button", id, class: kind, on: { click: handler } }, text);
  const canFollow = a.current_version !== null && !followsLatest(a);
  return {
    serve,
    bar: h(
      "div",
      { class: "row actions" },
      before === null ? null : button("rollback", `Roll back to v${before}`, rollback),
      canFollow ? button("follow-latest", "Follow latest", follow) : null,
      button("delete-adapter", `Delete ${a.name}`, remove, "danger"),
    ),
  };
}

function servingText(a) {
  const v = a.current_version;
  if (v === null) return "no version";
  if (followsLatest(a)) return `v${v}, following the latest: each new upload is served once stored`;
  return (
    `v${v}, held (latest v${a.latest_version}): ` +
    "new uploads are stored, not served, until you choose"
  );
}

/** #/adapters/{name}: one adapter, what it serves, its versions, and how to call it. Another
 * tenant's adapter is as absent here as in the API (404 either way). */
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
  const place = h("div", { id: "adapter-actions-result" });
  const { serve, bar } = actions(app, a, versions, place);
  const rows = versions.map((v) => [
    `v${v.version}`,
    String(v.rank),
    String(v.alpha),
    v.target_modules.join(", "),
    bytes(v.size_bytes),
    v.base_model,
    h("code", { class: "digest" }, v.digest),
    signer(v),
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
      h("dd", { id: "serving" }, servingText(a)),
      h("dt", {}, "Rollout"),
      h("dd", { id: "rollout" }, rolloutFact(a)),
      h("dt", {}, "Latest"),
      h("dd", {}, a.latest_version === null ? "" : `v${a.latest_version}`),
      h("dt", {}, "Updated"),
      h("dd", {}, time(a.updated_at)),
      h("dt", {}, "Signed by"),
      h("dd", { id: "signed-by" }, a.current ? signer(a.current) : ""),
    ),
    bar,
    rolloutControls(app, a, versions, place),
    place,
    a.current_version === null ? null : howToCall(app, a),
    h(
      "section",
      { "aria-labelledby": "versions-title" },
      h("h2", { id: "versions-title" }, "Versions"),
      table(
        "Every version, oldest first; versions are immutable",
        [
          "Version", "Rank", "Alpha", "Targets", "Size", "Base model", "Digest", "Signed by",
          "Created", "By", "",
        ],
        rows,
      ),
    ),
  );
}

// The signing key a version's signature was verified with at upload (docs/security.md,
// "Signed adapters"), or "unsigned"; the title holds the message it signs.
function signer(v) {
  if (!v.signing_key_id) return "unsigned";
  return h(
    "code",
    { class: "key-id", title: `signature verified over ${v.signed_digest}` },
    v.signing_key_id,
  );
}
