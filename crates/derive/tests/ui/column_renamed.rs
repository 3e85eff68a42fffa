#![allow(dead_code)]

#[derive(shardline_derive::Entity)]
#[shardline(table = "photos")]
struct Photo {
    id: i64,
    #[shardline(column = "Caption")]
    caption: String,
}

#[derive(shardline_derive::NewRow)]
#[shardline(entity = Photo)]
struct NewPhoto {
    #[shardline(user)]
    user_id: i64,
    #[shardline(column = "caption\"")]
    caption: String,
}

fn main() {}
