#![allow(dead_code)]

// 64 bytes: one more than Postgres keeps (it would silently cut the 64th).
#[derive(shardline_derive::Entity)]
#[shardline(table = "photos_photos_photos_photos_photos_photos_photos_photos_photos_p")]
struct Photo {
    id: i64,
}

#[derive(shardline_derive::NewRow)]
#[shardline(entity = Photo)]
struct NewPhoto {
    #[shardline(user)]
    user_id: i64,
    #[shardline(column = "caption_caption_caption_caption_caption_caption_caption_captionx")]
    caption: String,
}

fn main() {}
