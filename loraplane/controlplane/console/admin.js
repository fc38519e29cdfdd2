// The admin views (admin token): tenants, their weights and quotas, their keys (a new key is
// shown once), and the pools with the slot and memory pressure their replicas report.

import { call } from "./api.js";
import { confirm } from "./confirm.js";
import { copyable, field, h, scrolling, table } from "./dom.js";
import { bytes, count, time, weight } from "./format.js";

const enc = encodeURIComponent;
const QUOTAS = [
  ["max_adapters", "Max adapters"],
  ["max_rank", "Max rank"],
  ["max_bytes", "Max bytes per adapter"],
  ["requests_per_minute", "Requests per minute"],
  ["tokens_per_minute", "Tokens per minute"],
];
// The rate limits take 0 for "no limit"; the other quotas refuse 0 (the API says why).
const UNLIMITED_AT_ZERO = new Set(["requests_per_minute", "tokens_per_minute"]);
// Edited beside them, not a column of the list: adapter memory the tenant's pins may take
// (each pin: its version's size times its replicas); 0 lets only the admin pin for it.
const FORM_QUOTAS = [...QUOTAS, ["max_pinned_bytes", "Max pinned bytes"]];
const ZERO_MEANS = { max_pinned_bytes: "0: only the admin pins" };
for (const key of UNLIMITED_AT_ZERO) ZERO_MEANS[key] = "0: unlimited";

/** A per-minute limit as people read it: 0 is "unlimited". */
function rate(n) {
  return Number(n) === 0 ? "unlimited" : count(n);
}
// A weight is a share of a contended replica's seats and tokens, relative to the other tenants'.
const WEIGHT_HINT = "Share of a busy replica (1: equal; up to 1000).";

/** A number input for a tenant's weight (a positive number, fractions allowed). */
function weightInput(value) {
  return h("input", { type: "number", min: "0.001", max: "1000", step: "any", inputmode: "decimal", value: String(value) });
}

/** #/tenants: every tenant and its quotas, and a form for a new one. */
export async function tenants(app) {
  const list = await call("GET", "v1/tenants");
  const name = h("input", { type: "text", required: true, maxlength: "63", autocomplete: "off" });
  const share = weightInput(1);
  const place = h("div", {});
  const create = app.guard(async () => {
    const body = { name: name.value.trim() };
    // left blank: the control plane's default; anything else is its to check (it names the field)
    if (share.value.trim() !== "") body.weight = Number(share.value);
    const created = await call("POST", "v1/tenants", body);
    app.notify(`Tenant ${created.name} created.`);
    window.location.hash = `#/tenants/${enc(created.name)}`;
  }, place);
  return h(
    "div",
    {},
    h("h1", {}, "Tenants"),
    table(
      `${list.length} tenant${list.length === 1 ? "" : "s"}`,
      ["Name", "Namespace", "Weight", ...QUOTAS.map(([, label]) => label), "Created"],
      list.map((t) => [
        h("a", { href: `#/tenants/${enc(t.name)}` }, t.name),
        t.namespace,
        weight(t.weight),
        count(t.max_adapters),
        count(t.max_rank),
        bytes(t.max_bytes),
        rate(t.requests_per_minute),
        rate(t.tokens_per_minute),
        time(t.created_at),
      ]),
    ),
    h(
      "section",
      { "aria-labelledby": "new-tenant-title" },
      h("h2", { id: "new-tenant-title" }, "New tenant"),
      h(
        "form",
        { class: "row", novalidate: true, on: { submit: create } },
        field("tenant-name", "Name", name, "A DNS label: its namespace in a cluster."),
        field("tenant-weight", "Weight", share, WEIGHT_HINT),
        h("div", { class: "field" }, h("button", { type: "submit" }, "Create tenant")),
      ),
      place,
    ),
  );
}

function quotaForm(app, tenant) {
  const inputs = FORM_QUOTAS.map(([key]) => {
    const min = key in ZERO_MEANS ? "0" : "1";
    return h("input", { type: "number", min, step: "1", value: String(tenant[key] ?? 0), dataset: { key } });
  });
  const share = weightInput(tenant.weight ?? 1);
  const place = h("div", {});
  const save = app.guard(async () => {
    const body = { weight: Number(share.value) };
    for (const input of inputs) body[input.dataset.key] = Number(input.value);
    await call("PATCH", `v1/tenants/${enc(tenant.name)}`, body);
    app.notify(`Quotas of ${tenant.name} saved.`);
    await app.refresh();
  }, place);
  return h(
    "section",
    { "aria-labelledby": "quotas-title" },
    h("h2", { id: "quotas-title" }, "Quotas"),
    h(
      "form",
      { class: "row", novalidate: true, on: { submit: save } },
      field("quota-weight", "Weight", share, WEIGHT_HINT),
      FORM_QUOTAS.map(([key, label], i) => field(`quota-${key}`, label, inputs[i], ZERO_MEANS[key] ?? null)),
      h("div", { class: "field" }, h("button", { type: "submit" }, "Save quotas")),
    ),
    place,
  );
}

function keys(app, tenant, list) {
  const label = h("input", { type: "text", maxlength: "100", autocomplete: "off" });
  const shown = h("div", { id: "new-key" });
  const create = app.guard(async () => {
    const made = await call("POST", `v1/tenants/${enc(tenant.name)}/keys`, { name: label.value });
    label.value = "";
    // The only time the key exists outside its owner: kept in this box, nowhere else.
    shown.replaceChildren(
      h(
        "div",
        { class: "once", role: "alert" },
        h("p", {}, h("strong", {}, `New key “${made.name}” for ${tenant.name}. `), "It is shown only now: copy it and give it to the tenant."),
        copyable(made.key, "the new key"),
      ),
    );
    tbody.replaceChildren(...(await rows()));
  }, shown);
  const revoke = (key) =>
    app.guard(async () => {
      const label = key.name ? ` (“${key.name}”)` : "";
      const yes = await confirm({
        question: `Revoke key ${key.prefix}…${label} of ${tenant.name}?`,
        consequence:
          "Every request with this key is refused from now on. A revoked key cannot be " +
          "restored: create a new one if the tenant still needs it.",
        action: "Revoke key",
        danger: true,
      });
      if (!yes) return;
      await call("DELETE", `v1/tenants/${enc(tenant.name)}/keys/${key.id}`);
      app.notify(`Key ${key.prefix}… revoked.`);
      tbody.replaceChildren(...(await rows()));
    }, shown);
  const row = (k) =>
    h(
      "tr",
      {},
      [
        String(k.id),
        k.name,
        h("code", {}, `${k.prefix}…`),
        time(k.created_at),
        time(k.last_used_at) || "never",
        k.revoked_at
          ? `revoked ${time(k.revoked_at)}`
          : h(
              "button",
              { type: "button", class: "danger small", "aria-label": `Revoke key ${k.prefix}`, on: { click: revoke(k) } },
              "Revoke",
            ),
      ].map((c) => h("td", {}, c)),
    );
  const rows = async () => (await call("GET", `v1/tenants/${enc(tenant.name)}/keys`)).map(row);
  const tbody = h("tbody", {}, list.map(row));
  const headers = ["ID", "Label", "Prefix", "Created", "Last used", ""];
  return h(
    "section",
    { "aria-labelledby": "keys-title" },
    h("h2", { id: "keys-title" }, "API keys"),
    scrolling(
      h(
        "table",
        { id: "keys" },
        h("thead", {}, h("tr", {}, headers.map((x) => h("th", { scope: "col" }, x)))),
        tbody,
      ),
    ),
    h(
      "form",
      { class: "row", novalidate: true, on: { submit: create } },
      field("key-label", "Label of a new key", label, "For people: who or what uses it."),
      h("div", { class: "field" }, h("button", { type: "submit" }, "Create key")),
    ),
    shown,
  );
}

/** #/tenants/{name}: one tenant's weight, quotas and keys. */
export async function tenant(app, name) {
  let t;
  let list;
  try {
    [t, list] = await Promise.all([
      call("GET", `v1/tenants/${enc(name)}`),
      call("GET", `v1/tenants/${enc(name)}/keys`),
    ]);
  } catch (error) {
    if (error.status !== 404) throw error;
    return h("div", {}, h("h1", {}, "Not found"), h("p", {}, `No tenant named “${name}”.`));
  }
  return h(
    "div",
    {},
    h("p", { class: "crumbs" }, h("a", { href: "#/tenants" }, "Tenants"), " / "),
    h("h1", {}, t.name),
    h("p", {}, `Namespace ${t.namespace}; created ${time(t.created_at)}.`),
    quotaForm(app, t),
    keys(app, t, list),
  );
}

function gauge(label, value, max, text) {
  const known = max > 0;
  return h(
    "span",
    { class: "gauge" },
    known ? h("meter", { min: "0", max: String(max), value: String(Math.min(value, max)), high: String(max * 0.8), optimum: "0", "aria-label": label }) : null,
    ` ${text}`,
  );
}

/** A replica's adapter slots: the bar is what runs (adapters with requests in flight), the
 * text adds what is cached (resident in the slots, ready for the next request). Cached
 * adapters fill the slots of an idle replica: that is not pressure. */
function slots(name, report, max) {
  const running = report.running_adapters || 0;
  const cached = report.slots_used || 0;
  return gauge(
    `Adapters running on ${name}`,
    running,
    max,
    `${running} running, ${cached} cached, of ${max} slots`,
  );
}

function replicas(pool) {
  const reported = (pool.pressure && pool.pressure.replicas) || {};
  const names = Object.keys(reported).sort();
  if (!names.length) return h("p", { class: "hint" }, "No replica has reported yet.");
  return table(
    `Pressure each replica last reported (${time(pool.pressure_at)}); running: adapters with ` +
      "requests in flight; cached: adapters resident in the slots",
    ["Replica", "Adapter slots", "Adapter memory", "KV cache", "Waiting adapters", "Deferred requests", "Reported"],
    names.map((n) => {
      const r = reported[n];
      const used = r.gpu_bytes || 0;
      const cap = r.gpu_bytes_capacity || 0;
      const kv = r.kv_usage || 0;
      return [
        n,
        slots(n, r, pool.max_loras),
        gauge(`Adapter memory of ${n}`, used, cap, cap ? `${bytes(used)} of ${bytes(cap)}` : bytes(used)),
        gauge(`KV cache of ${n}`, kv, 1, `${Math.round(kv * 100)}%`),
        count(r.waiting_adapters),
        count(r.deferred),
        time(r.time),
      ];
    }),
  );
}

/** #/pools: every pool, its limits and its replicas' pressure. */
export async function pools() {
  const list = await call("GET", "v1/pools");
  return h(
    "div",
    {},
    h("h1", {}, "Pools"),
    list.length ? null : h("p", {}, "No pools: register one with POST /v1/pools."),
    list.map((p) =>
      h(
        "section",
        { class: "pool", "aria-label": `Pool ${p.namespace}/${p.name}` },
        h("h2", {}, `${p.namespace}/${p.name}`),
        h(
          "dl",
          { class: "facts" },
          h("dt", {}, "Base model"),
          h("dd", {}, `${p.base_model.name} (${p.base_model.uri})`),
          h("dt", {}, "Limits"),
          h("dd", {}, `max rank ${p.max_lora_rank}, ${p.max_loras} adapter slots per replica, ${p.max_cpu_loras} in CPU memory${p.max_cpu_lora_bytes == null ? "" : ` (${p.max_cpu_lora_bytes} bytes at most)`}`),
        ),
        replicas(p),
      ),
    ),
  );
}
