// Images in a user's message: read from a chosen or pasted file as a data URL (PNG, JPEG, WebP,
// GIF: what the server decodes), shown as thumbnails (with a remove control while the message is
// being written), kept with the message in the store and sent as OpenAI `image_url` parts.
// Only data URLs of those types are ever put in an <img> (a stored conversation is checked on
// load), and the page's policy allows images from `data:` and the server alone.

import { el } from "./markdown.js";

export const MEDIA_TYPES = ["image/png", "image/jpeg", "image/webp", "image/gif"];
const DATA_URL = /^data:image\/(png|jpeg|webp|gif);base64,[A-Za-z0-9+/]+={0,2}$/;

/** The images of a stored message: its data URLs of the types above, or null for none. */
export function cleanImages(images) {
  if (!Array.isArray(images)) return null;
  const out = images.filter((url) => typeof url === "string" && DATA_URL.test(url));
  return out.length ? out : null;
}

/** A file's contents as a data URL; refused unless it is one of MEDIA_TYPES. */
export function readImage(file) {
  if (!MEDIA_TYPES.includes(file.type)) {
    return Promise.reject(new Error(`${file.name || "the pasted file"} is not a PNG, JPEG, WebP ` +
      "or GIF image"));
  }
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(new Error(`cannot read ${file.name}: ${reader.error?.message}`));
    reader.readAsDataURL(file);
  });
}

/** The image files a paste carries (none when it is text only). */
export function pastedImages(clipboard) {
  return Array.from(clipboard?.files ?? []).filter((f) => f.type.startsWith("image/"));
}

/** A user message's content as sent: its images as `image_url` parts, then its text; the text
 * alone when it has no images. */
export function messageContent(text, images) {
  if (!images?.length) return text;
  const parts = images.map((url) => ({ type: "image_url", image_url: { url } }));
  if (text) parts.push({ type: "text", text });
  return parts;
}

/** Thumbnails of `images`; with `onRemove(i)`, each has a remove control. */
export function imagesView(images, onRemove = null) {
  const list = el("div", "msg-images");
  images.forEach((url, i) => {
    const item = list.appendChild(el("figure", "msg-image"));
    const img = item.appendChild(el("img"));
    img.src = url;
    img.alt = `image ${i + 1}`;
    if (onRemove) {
      const remove = item.appendChild(el("button", "image-remove", "×"));
      remove.type = "button";
      remove.title = "remove this image";
      remove.addEventListener("click", () => onRemove(i));
    }
  });
  return list;
}

/** The images attached to the message being written, shown in `box`. */
export class Attachments {
  constructor(box) {
    this.box = box;
    this.images = [];
  }

  set(images) {
    this.images = [...images];
    this.render();
  }

  add(url) {
    this.set([...this.images, url]);
  }

  render() {
    this.box.hidden = !this.images.length;
    this.box.replaceChildren(...(this.images.length ? [imagesView(this.images, (i) =>
      this.set(this.images.filter((_, k) => k !== i)))] : []));
  }
}
