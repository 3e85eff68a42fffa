#![allow(dead_code)]

// The entity as named by `entity = Photo` (the derive refuses before it reads it).
struct Photo {
    id: i64,
    user_id: i64,
    url: String,
}

// Every insert would fail at run time (42701, column specified more than once).
#[derive(shardline_derive::NewRow)]
#[shardline(entity = Photo)]
struct NewPhoto {
    #[shardline(user)]
    user_id: i64,
    #[shardline(column = "url")]
    link: String,
    url: String,
}

fn main() {}
