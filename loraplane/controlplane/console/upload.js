// Uploading an adapter: drop the files (or choose them), watch them go out, then follow the
// background job when the control plane ingests a big upload in the background (202).

import { ApiError, call, session, upload } from "./api.js";
import { append, field, h } from "./dom.js";
import { bytes, time } from "./format.js";
import { ignoredNote, outcome } from "./tenant.js";

const POLL_MS = 500;
const enc = encodeURIComponent;

function chosenList(files) {
  if (!files.length) return h("p", { class: "hint" }, "No files chosen yet.");
  return h(
    "ul",
    { class: "files", "aria-label": "Chosen files" },
    files.map((f) => h("li", {}, `${f.name} (${bytes(f.size)})`)),
  );
}

/** The files the control plane left out of an upload (a Trainer's training_args.bin, ...). */
function ignoredList(files) {
  const note = ignoredNote(files);
  return note ? h("p", { class: "ignored", id: "upload-ignored" }, note) : null;
}

function finished(app, name, data) {
  const v = data.version.version;
  const text = data.created
    ? `Stored ${name} v${v} (rank ${data.version.rank}, ${bytes(data.version.size_bytes)}).`
    : `Identical to ${name} v${v}: nothing new was stored.`;
  app.notify(text);
  return h(
    "div",
    {},
    h("p", { class: "ok" }, text, " ", h("a", { href: `#/adapters/${enc(name)}` }, `See ${name}`)),
    ignoredList(data.ignored),
  );
}

/** What a base model's option says: its name, or that it cannot take uploads yet. */
function offerText(offer) {
  return offer.ready ? offer.name : `${offer.name} (not ready: its replicas have not reported it)`;
}

/** What an upload for `offer` must meet, in words. */
function offerLimits(offer) {
  if (!offer) return "";
  if (!offer.ready) {
    return "Its pools wait for their replicas to report the model: uploads for it are refused until then.";
  }
  return (
    `${offer.model_type}, ${offer.num_layers} layers, hidden size ${offer.hidden_size}: ` +
    `rank up to ${offer.max_lora_rank}, up to ${bytes(offer.max_adapter_bytes)} per adapter.`
  );
}

/** The base model chosen first: the one the tenant's latest adapter uses if it can take an
 * upload, else the first that can, else the first. */
function preferred(offers, adapters) {
  const latest = [...adapters].sort((x, y) => String(y.updated_at).localeCompare(String(x.updated_at)));
  const ready = offers.filter((o) => o.ready);
  const mine = latest.find((a) => ready.some((o) => o.name === a.base_model));
  return mine ? mine.base_model : (ready[0] || offers[0]).name;
}

/** Poll a background upload until it ends; `show(node)` gets each state. */
async function follow(app, job, show, stillHere) {
  const started = Date.now();
  while (stillHere()) {
    if (job.status === "succeeded") return show(finished(app, job.name, job.result));
    if (job.status === "failed") {
      return show(h("div", {}, h("p", {}, `Upload of ${job.name} refused:`), outcome(app, job)));
    }
    const seconds = Math.round((Date.now() - started) / 1000);
    show(
      h(
        "div",
        { class: "job" },
        h("label", { for: "job-progress" }, `Background ingest of ${job.name}: ${job.status}`),
        h("progress", { id: "job-progress" }),
        h("p", { class: "hint" }, `Job ${job.id}, queued ${time(job.created_at)}, ${seconds} s so far.`),
      ),
    );
    await new Promise((resolve) => setTimeout(resolve, POLL_MS));
    job = await call("GET", `v1/uploads/${enc(job.id)}`);
  }
  return null;
}

/** #/upload: the upload form. */
export async function view(app) {
  const [adapters, offers] = await Promise.all([call("GET", "v1/adapters"), call("GET", "v1/base-models")]);
  let files = [];

  const name = h("input", {
    type: "text",
    required: true,
    maxlength: "63",
    autocomplete: "off",
    spellcheck: "false",
  });
  const chosenBase = offers.length ? preferred(offers, adapters) : "";
  const base = h(
    "select",
    { required: true },
    offers.map((o) => h("option", { value: o.name }, offerText(o))),
  );
  base.value = chosenBase;
  const limits = h("p", { class: "hint", id: "up-base-limits" }, "");
  const showLimits = () => {
    limits.textContent = offerLimits(offers.find((o) => o.name === base.value));
  };
  base.addEventListener("change", showLimits);
  showLimits();
  // any file: a Trainer's checkpoint folder is uploaded whole, its extra files are ignored
  const picker = h("input", { type: "file", multiple: true });
  const chosen = h("div", { id: "chosen" }, chosenList(files));
  const sent = h("progress", { id: "upload-progress", max: "100", value: "0" });
  const sentText = h("span", { id: "upload-progress-text" }, "");
  const progress = h(
    "div",
    { class: "sending", hidden: true },
    h("label", { for: "upload-progress" }, "Sending"),
    sent,
    sentText,
  );
  const result = h("div", { id: "upload-result", "aria-live": "polite" });
  const choose = (list) => {
    files = [...list];
    chosen.replaceChildren(chosenList(files));
  };
  picker.addEventListener("change", () => choose(picker.files));

  const zone = h(
    "div",
    {
      class: "dropzone",
      id: "dropzone",
      on: {
        dragover: (event) => {
          event.preventDefault();
          zone.classList.add("over");
        },
        dragleave: () => zone.classList.remove("over"),
        drop: (event) => {
          event.preventDefault();
          zone.classList.remove("over");
          choose(event.dataTransfer.files);
        },
      },
    },
    field(
      "up-files",
      "Adapter files",
      picker,
      "adapter_config.json and adapter_model.safetensors, or one .tar.gz or .zip holding them; " +
        "a Trainer's checkpoint folder may go whole (its other files are ignored, never opened). " +
        "Drop them here, or choose them.",
    ),
    chosen,
  );

  const submit = h("button", { type: "submit", id: "upload-submit", disabled: !offers.length }, "Upload");
  const baseField = offers.length
    ? append(field("up-base", "Base model", base, "The base model it was trained on."), [limits])
    : h(
        "p",
        { class: "error", id: "up-base-none", role: "alert" },
        "No base model can take an upload yet: the admin has not registered a pool. " +
          "Ask your platform's admin to add one; this form works once a pool serves a base model.",
      );
  base.setAttribute("aria-describedby", "up-base-hint up-base-limits");
  const form = h(
    "form",
    { id: "upload-form", novalidate: true },
    h("div", { class: "row" }, [
      field("up-name", "Adapter name", name, "1 to 63 of a-z, 0-9, - . _; an existing name gets a new version."),
      baseField,
    ]),
    zone,
    submit,
    progress,
  );

  form.addEventListener(
    "submit",
    app.guard(async () => {
      result.replaceChildren();
      if (!files.length) {
        result.replaceChildren(
          h("p", { class: "error", role: "alert" }, "Choose or drop the adapter's files first."),
        );
        return;
      }
      const data = new FormData();
      data.append("name", name.value.trim());
      data.append("base_model", base.value.trim());
      for (const f of files) data.append("files", f, f.name);
      const total = files.reduce((n, f) => n + f.size, 0);
      submit.disabled = true;
      progress.hidden = false;
      sent.value = 0;
      sentText.textContent = `0 of ${bytes(total)}`;
      const when = new Date().toISOString();
      try {
        const answer = await upload(data, (done, all) => {
          sent.value = Math.round((100 * done) / all);
          sentText.textContent = `${bytes(done)} of ${bytes(all)} (${sent.value}%)`;
          if (done >= all) sentText.textContent += "; validating…";
        });
        sent.value = 100;
        const body = answer.data || {};
        if (answer.status === 202 && body.id) {
          const stillHere = () => document.body.contains(form);
          await follow(app, body, (node) => result.replaceChildren(node), stillHere);
        } else if (answer.status === 202) {
          result.replaceChildren(
            h("p", { class: "ok" }, `Staged ${body.name}: the operator validates it; it is listed under Adapters once stored.`),
            ignoredList(body.ignored),
          );
        } else {
          session.remember({ when, name: body.name, status: "succeeded", result: body });
          result.replaceChildren(finished(app, body.name, body));
        }
      } catch (error) {
        if (error instanceof ApiError && error.status !== 401) {
          session.remember({
            when,
            name: name.value.trim(),
            status: "failed",
            error: { code: error.code, message: error.message },
          });
        }
        throw error;
      } finally {
        submit.disabled = false;
      }
    }, result),
  );

  return h(
    "div",
    {},
    h("h1", {}, "Upload an adapter"),
    h(
      "p",
      {},
      "A PEFT LoRA adapter is checked before anything is stored; a refused one says why. " +
        "Big uploads are ingested in the background: this page follows them.",
    ),
    form,
    result,
  );
}
